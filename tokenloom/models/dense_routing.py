"""Which matmul a dense bfloat16 `Linear` with a prepacked oneDNN copy uses for 2 to SKINNY_MAX_ROWS rows,
chosen for this CPU at start-up.

A decode step of a few sequences (2 to 8 rows: a few users, a speculative check) is bound by streaming the
weights from memory. The C++ skinny kernel reads each weight row once for all rows of x; oneDNN's prepacked
GEMM is the faster choice from some row count on, and where the two cross depends on the CPU (AMX or not,
its caches and memory), not on its vendor. So the engine measures both on one synthetic stack of layers
bigger than the last-level cache (`calibrate`), as a model's are, and keeps the skinny kernel up to the
largest row count at and below which it won at every count measured. The value is process-wide: the
Python `Linear` and the C++ decode stack's `FusedLinear` read the same number (`apply` sets both), so the
two paths keep computing the same values (tests/test_decode_stack.py). Measured once per process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from tokenloom.errors import ConfigError
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.models.layers import Linear
from tokenloom.quant.routing import fastest_ms

log = logging.getLogger("tokenloom.models")

CALIBRATION_ROWS = tuple(range(2, SKINNY_MAX_ROWS + 1))
# The synthetic stack: 12 layers of 2048 x 1024 bfloat16, 48 MiB: past the last-level cache of the CPUs
# measured, so each call streams its weights from memory as a decode step does.
_SHAPE, _LAYERS = (2048, 1024), 12


@dataclass(frozen=True)
class DenseRouting:
    skinny_max_rows: int  # rows up to which the skinny kernel serves layers that have a packed copy
    source: str  # "measured" | "set"
    timings: tuple[tuple[int, float, float], ...] = ()  # (rows, skinny ms, packed ms), fastest of the calls

    def describe(self) -> str:
        text = (f"dense bf16 matmuls with a prepacked copy: the skinny kernel up to {self.skinny_max_rows} "
                f"row(s), oneDNN's prepacked GEMM beyond ({self.source})")
        if self.timings:
            text += "; skinny vs packed ms at " + ", ".join(f"{m} rows {a:.2f}/{b:.2f}" for m, a, b in self.timings)
        return text


def crossover(timings: Sequence[tuple[int, float, float]]) -> int:
    """The largest row count up to which skinny was at least as fast as packed at every count measured
    (1 if it lost at the first). `timings`: (rows, skinny, packed), rows ascending from 2."""
    best = 1
    for rows, skinny, packed in timings:
        if skinny > packed:
            break
        best = rows
    return best


def apply(kernels: ModuleType, rows: int) -> None:
    """Route 1..rows rows of prepacked layers to the skinny kernel, in Python and in the C++ stack."""
    if not 1 <= rows <= SKINNY_MAX_ROWS:
        raise ConfigError(f"the skinny kernel serves 1 to {SKINNY_MAX_ROWS} rows, got {rows}")
    kernels.set_skinny_packed_max_rows(rows)
    Linear.skinny_rows_packed = rows


def calibrate(kernels: ModuleType, rows: Sequence[int] = CALIBRATION_ROWS, reps: int = 5) -> DenseRouting:
    """Time both matmuls over the synthetic stack at each row count; about 0.2-0.5 s."""
    n, k = _SHAPE
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _ in range(_LAYERS)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, SKINNY_MAX_ROWS) for w in weights]
    timings = []
    for m in rows:
        x = torch.randn(m, k, generator=gen).bfloat16()

        def skinny() -> None:
            for w in weights:
                kernels.skinny_linear(x, w, None)

        def onednn() -> None:
            for p in packed:
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

        a, b = fastest_ms([skinny, onednn], reps)
        timings.append((m, a, b))
    return DenseRouting(crossover(timings), "measured", tuple(timings))


@functools.cache
def measured(kernels: ModuleType) -> DenseRouting:
    """`calibrate` once per process and kernel module."""
    return calibrate(kernels)


def choose(kernels: ModuleType) -> DenseRouting:
    """Measure (once per process), apply and log the crossover."""
    routing = measured(kernels)
    apply(kernels, routing.skinny_max_rows)
    log.info("%s", routing.describe())
    return routing
