"""Builds and loads the C++ CPU kernels (csrc/) with torch's JIT extension loader, once per machine.

Kernels: paged decode attention, residual add + RMSNorm, SiLU-and-mul, rotary embedding, few-row bf16
matmul (decode and speculative verification steps). Each has a
pure-torch twin (models/layers.py, attention/sdpa.py) that is the test oracle and the path on CUDA.

The first load compiles (about a minute on 2 cores) into torch's extension cache; later loads take
milliseconds. When no compiler is available the loader returns None and callers use the torch path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

log = logging.getLogger("tokenloom.kernels")

_CSRC = Path(__file__).parent / "csrc"


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="tokenloom_cpu_kernels",
            sources=[str(_CSRC / f) for f in ("bindings.cpp", "paged_decode.cpp", "elementwise.cpp", "skinny_gemm.cpp")],
            # -march=native: built on the machine that runs it. -fno-math-errno lets exp() vectorise.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # a missing compiler or ninja must not stop the engine: fall back to torch
        log.warning("CPU kernels unavailable (%s); using the torch SDPA path for decode attention", e)
        return None
