"""Builds and loads the C++ CPU kernels (csrc/) with torch's JIT extension loader, once per machine.

Kernels: paged decode attention, KV cache writes (INT8: quantized on the way), residual add + RMSNorm,
SiLU-and-mul, rotary embedding, few-row bf16 matmul (decode and speculative verification steps), the
weight-only int8 / int4 matmuls of tokenloom/quant, and the decode stack that calls them all for a whole
decode step (csrc/decode_stack.cpp, engine/fused_decode.py). Each has a pure-torch twin
(models/layers.py, attention/sdpa.py, attention/paged_kv.py, quant/linear.py, the Python model) that is
the test oracle and the path on CUDA.

All sources build into one module: the first load compiles (about two minutes on 2 cores) into torch's
extension cache; later loads take milliseconds. When no compiler is available the loader returns None
and callers use the torch path. The numbers both sides rely on (row limits, code layout) come from
limits.py, passed to the compiler as -D flags; the build is named after them.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from tokenloom.kernels.limits import build_tag, compiler_defines

log = logging.getLogger("tokenloom.kernels")

_CSRC = Path(__file__).parent / "csrc"


_SOURCES = ("bindings.cpp", "paged_decode.cpp", "kv_write.cpp", "elementwise.cpp", "skinny_gemm.cpp",
            "quant_gemm.cpp", "decode_stack.cpp")


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        return load(
            # Named after the shared limits' values: a build made with other values is never reused.
            name=f"tokenloom_cpu_kernels_{build_tag()}",
            sources=[str(_CSRC / f) for f in _SOURCES],
            # -march=native: built on the machine that runs it. -fno-math-errno lets exp() vectorise.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", *compiler_defines()],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # a missing compiler or ninja must not stop the engine: fall back to torch
        log.warning("CPU kernels unavailable (%s); using the torch SDPA path for decode attention", e)
        return None


@functools.cache
def load_quant_kernels() -> ModuleType | None:
    """The kernel module when it has the int8 / int4 weight-only matmuls (csrc/quant_gemm.cpp), or None
    when it cannot be built or the CPU lacks AVX512-BF16 or AVX512-VNNI (the quantized layers then fall
    back to dequantize + F.linear)."""
    mod = load_cpu_kernels()
    if mod is None:
        return None
    if not mod.quant_available():
        log.warning("quantized matmul kernels need AVX512-BF16 and AVX512-VNNI; quantized layers dequantize per call")
        return None
    return mod
