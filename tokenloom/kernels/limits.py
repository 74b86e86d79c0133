"""Numbers the C++ kernels (csrc/) and the Python code must agree on, defined once, here.

The kernel build (kernels/__init__.py) passes each one to the compiler as `-DTOKENLOOM_<NAME>=<value>`
(csrc/kernels.h turns them into constants and refuses to compile without them) and names the build
after their values, so a build made with other values is never reused. The built module reports the
values it was compiled with (`limits()`; tests/test_kernel_limits.py compares them with these).

This module imports nothing heavy: the Python paths read it whether or not the kernels build.
"""

from __future__ import annotations

import hashlib

# The few-row matmuls (csrc/skinny_gemm.cpp skinny_linear, quant_gemm.cpp's few-row paths) serve
# 1..SKINNY_MAX_ROWS rows of x: decode steps and speculative verification. Each row count is compiled
# as its own kernel.
SKINNY_MAX_ROWS = 8
# A dense layer's prepacked (oneDNN-blocked) weight serves 2..PACKED_MAX_ROWS rows (models/layers.py
# Linear, csrc/decode_stack.cpp FusedLinear); bigger prefill chunks go to F.linear, whose per-call
# weight reorder is amortized there (docs/performance-notes.md#prepacked-weights).
PACKED_MAX_ROWS = 256
# The quantized code layout (quant/layout.py, csrc/quant_gemm.cpp): each row's inputs are zero-padded
# to whole chunks of QUANT_CHUNK, and int4 output channels are stored in blocks of INT4_BLOCK. Both are
# fixed by the AVX-512 kernels (a chunk of int8 codes is one 512-bit load; an int4 block is vpdpbusd's
# 16 int32 lanes; kernels.h asserts them) and by the stored checkpoints' LAYOUT_VERSION.
QUANT_CHUNK = 64
INT4_BLOCK = 16

SHARED: dict[str, int] = {
    "SKINNY_MAX_ROWS": SKINNY_MAX_ROWS,
    "PACKED_MAX_ROWS": PACKED_MAX_ROWS,
    "QUANT_CHUNK": QUANT_CHUNK,
    "INT4_BLOCK": INT4_BLOCK,
}


def compiler_defines() -> list[str]:
    """The values as compiler flags: -DTOKENLOOM_SKINNY_MAX_ROWS=8 ..."""
    return [f"-DTOKENLOOM_{name}={value}" for name, value in SHARED.items()]


def build_tag() -> str:
    """A short digest of the values, part of the kernel build's name."""
    return hashlib.sha1(repr(sorted(SHARED.items())).encode()).hexdigest()[:8]
