"""Which kernel the quantized matmuls use for how many rows of x, chosen for this CPU at start-up.

Up to `quant_tile_max_rows` rows the kernels dot int8 activations with the quantized codes (vpdpbusd: the
few-row kernels, then kernels/csrc/qtile.h's cache-resident tiles), reading each weight byte from memory
once per call; beyond it they expand the weight to bf16 and hand it to oneDNN, which pays a bf16 copy of
the weight per call but runs AMX where the CPU has it. Where the CPU has AMX the tiles can be dotted by it
instead of vpdpbusd (csrc/qtile_amx.h): AMX-INT8 (the same outputs bit for bit) or AMX-BF16 (the tile
decoded to bf16 in the cache, x not quantized: the expand route's numbers without its trip through
memory). Where the routes cross depends on the CPU (AMX or not, core count, cache and memory speed),
not on its vendor, so the engine measures it at start-up (`calibrate`): the routes on one synthetic layer
at row counts from 16 up to the engine's step budget (--max-num-batched-tokens: no linear of a step sees
more rows); the tiles' dot is the one that stays ahead of the expansion up to the most rows (the faster at
16 rows on a tie), and the tiles are kept up to the largest count below which they win at every count
measured. The counts must reach the budget: served at 64 users, a
step holding a 512-token chunk of arriving prompts ran 532 ms through the expansion against 409 ms through
the tiles (Q4_1 SmolLM2, Zen 4), when the measurement stopped at 256 rows and sent every larger call to
the expansion; and need not go past it (at the default 512, the 1,024 and 2,048-row calls took ~0.5 s of
start-up). `--quant-tile-max-rows N` sets the crossover instead (the dot is still measured).
Below the tiles, int4 layers can keep the few-row kernel past SKINNY_MAX_ROWS rows, in panels of that
many rows, each block of W dotted with every panel while it is in L1 (`quant_panel_max_rows`): the tiles
decode every weight into a cache-resident tile of int8 codes per call, a fixed cost the few-row kernel
never pays, while its work per row of x is higher. On Zen 4 (no AMX) the panels were 1.2-1.4x faster than
the tiles at 9-24 rows and level at ~48 (Q4_1, SmolLM2's linears x 30 out of cache); with AMX dots the tiles
may win from fewer rows. So that crossover is measured too, at the counts up to PANEL_ROWS (panels against
the fastest of the tiles' dots at each count), and kept where the panels won by PANEL_MARGIN at every
count up to it.
The kernel module holds the values for the whole process (quant_linear and kquant_linear, the fused
decode stack included); they are logged with the timings behind them. The measurement is made once per
process and budget (`measured`): a process that builds several engines (tests, a benchmark sweep) sees the
same choice for the same budget.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from tokenloom.errors import ConfigError
from tokenloom.kernels.limits import SKINNY_MAX_ROWS

if TYPE_CHECKING:
    from tokenloom.quant.linear import Int4Linear

log = logging.getLogger("tokenloom.quant")

CALIBRATION_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)  # the counts timed, up to a step's budget
PANEL_ROWS = 64  # the int4 few-row kernel's panels are timed against the tiles up to this many rows
# The panels are kept at a count only where they took at most this fraction of the tiles' time. The two
# routes round differently (the same int8-x products summed in another order), and the model's next
# layer quantizes x again, so a near-tie between two tokens can go either way: a crossover that a few
# percent of timing noise moves from one process to the next would move such answers with it (a
# 37-token prompt on the default model answered "The capital..." through the tiles and "L'Etoile..."
# through the panels, the two candidates 0.08 nats apart in float32). On the 2-core EPYC the panels won by
# 12% at 16 rows, 3% at 32 and lost by 2% at 64: the margin keeps 16.
PANEL_MARGIN = 0.95
# The panels' calls are short (~0.15 ms at 16 rows on the synthetic layer) and the margin is narrow, so their
# fastest time is taken over more calls than the routes' (calibrate's `reps`): a make-serve start once timed
# 0.14 / 0.15 ms at 16 rows, within the margin, and served the panels up to 8 rows only.
PANEL_REPS_FACTOR = 3
ROUTE_REPS = 7  # calls per route and count at start-up; the fastest counts (fastest_ms)
# The synthetic layer: int4 with groups of 32 (GGUF Q4_0/Q4_1's form, the default model's), 2048 x 1024:
# 1 MiB of codes, past the L2 cache of the CPUs measured, as a model's layers are.
_SHAPE = (2048, 1024)


DOTS = ("vnni", "amx-int8", "amx-bf16")  # how the tiles meet x: the kernel's quant_tile_dot indices


@dataclass(frozen=True)
class QuantRouting:
    tile_max_rows: int
    source: str  # "measured" | "set" (--quant-tile-max-rows)
    amx: bool  # the CPU has AMX (torch's feature detection)
    tile_dot: str = "vnni"  # of DOTS
    tile_dot_from: int = 0  # rows of x from which the tiles take tile_dot (vnni below)
    # (rows, {dot: tiles ms}, expand ms) per count measured, fastest of the calls; empty when not measured
    timings: tuple[tuple[int, Mapping[str, float], float], ...] = ()
    panel_max_rows: int = SKINNY_MAX_ROWS  # int4's few-row kernel, in panels past SKINNY_MAX_ROWS, up to here
    panel_timings: tuple[tuple[int, float, float], ...] = ()  # (rows, panels ms, fastest tiles ms)

    def describe(self) -> str:
        panels = (f" (int4 in panels of {SKINNY_MAX_ROWS} up to {self.panel_max_rows})"
                  if self.panel_max_rows > SKINNY_MAX_ROWS else "")
        text = (f"quantized matmuls: int8-activation kernels up to {SKINNY_MAX_ROWS} rows{panels}, then tiles dotted by "
                f"{self.tile_dot}{self._from()} up to {self.tile_max_rows} rows, W expanded to bf16 for oneDNN beyond "
                f"({self.source}; CPU AMX: {'yes' if self.amx else 'no'})")
        if self.timings:
            text += "; ms at " + ", ".join(
                f"{m} rows " + " / ".join(f"{d} {t:.2f}" for d, t in dots.items()) + f" / expand {e:.2f}"
                for m, dots, e in self.timings)
        if self.panel_timings:
            text += "; int4 panels / tiles ms at " + ", ".join(f"{m} rows {p:.2f} / {t:.2f}"
                                                              for m, p, t in self.panel_timings)
        return text

    def _from(self) -> str:
        return f" from {self.tile_dot_from} rows (vnni below)" if self.tile_dot != "vnni" and self.tile_dot_from > 0 else ""


def cpu_has_amx() -> bool:
    """Whether torch's CPU feature detection sees AMX tiles (no vendor names involved)."""
    try:
        return bool(torch.cpu.get_capabilities().get("amx_tile", False))
    except (AttributeError, RuntimeError):
        return False


def crossover(timings: Sequence[tuple[int, float, float]], margin: float = 1.0) -> int:
    """The largest row count up to which the tiles took at most `margin` x the expansion's time at every
    count measured (SKINNY_MAX_ROWS if they lost at the first). `timings`: (rows, tiles, expand), rows
    ascending; or any two routes, the lower first (time_panels: (rows, panels, tiles))."""
    best = SKINNY_MAX_ROWS
    for rows, tiles, expand in timings:
        if tiles > margin * expand:
            break
        best = rows
    return best


def fastest_ms(fns: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """Each of `fns`' fastest time over `reps` calls, the calls interleaved (a, b, a, b, ...).

    The fastest, not the median: interference (another process, a server still exiting, page faults of a
    first touch) only ever adds time, and at start-up it can last for most of a short measurement. One
    such burst once made the tiles' median at 16 rows 4.15 ms against 0.29 ms undisturbed, and moved a
    whole server onto the slow route for its lifetime. Interleaving shares a burst between the routes."""
    for fn in fns:
        fn()  # the first call builds oneDNN's primitive and the kernels' scratch
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return [b * 1e3 for b in best]


def tile_dot(timings: Sequence[tuple[int, Mapping[str, float], float]]) -> tuple[str, int, int]:
    """(dot, crossover, from): the tiles' dot that beats the expansion up to the most rows (the fastest at the
    first count on a tie; vnni where none other was measured), and the first measured count from which it is
    at least as fast as vnni at every count to the crossover (vnni below: AMX-BF16's decode of the weight
    costs the same at any row count and pays for itself only from some count on); 0 for vnni itself."""
    if not timings:
        return "vnni", SKINNY_MAX_ROWS, 0
    reach = {d: crossover([(m, dots[d], e) for m, dots, e in timings]) for d in timings[0][1]}
    best = max(reach, key=lambda d: (reach[d], -timings[0][1][d]))
    if best == "vnni":
        return best, reach[best], 0
    counts = [(m, dots) for m, dots, _ in timings if m <= reach[best]]
    start = len(counts)  # past the last count where vnni was faster
    while start > 0 and counts[start - 1][1][best] <= counts[start - 1][1]["vnni"]:
        start -= 1
    first = counts[start][0] if start < len(counts) else reach[best] + 1  # never: vnni to the end
    return best, reach[best], 0 if start == 0 else first


def dots_available(kernels: ModuleType) -> tuple[str, ...]:
    """The tiles' dots this kernel module can use here (older builds: vnni alone)."""
    return tuple(getattr(kernels, "quant_tile_dots", lambda: ["vnni"])())


def calibrate(kernels: ModuleType, rows: Sequence[int] = CALIBRATION_ROWS, reps: int = ROUTE_REPS) -> QuantRouting:
    """Time the routes (each usable dot of the tiles, the expansion) on the synthetic layer, then int4's
    panels against the tiles (time_panels), set the crossovers and the dot in `kernels`; about a second
    (two or three with AMX's two dots)."""
    layer, gen = _synthetic_layer()
    k = layer.in_features
    args = (layer.codes, layer.scales, layer.mins, layer.bits, None)
    dots = dots_available(kernels)

    def tiles(x: torch.Tensor, dot: str) -> Callable[[], object]:
        def call() -> object:
            if len(dots) > 1:
                kernels.set_quant_tile_dot(DOTS.index(dot))
            return kernels.quant_linear(x, *args, 1)
        return call

    timings = []
    if len(dots) > 1:
        kernels.set_quant_tile_dot_from(0)  # each dot timed at every count
    panels_before = getattr(kernels, "quant_panel_max_rows", lambda: SKINNY_MAX_ROWS)()
    if hasattr(kernels, "set_quant_panel_max_rows"):
        kernels.set_quant_panel_max_rows(SKINNY_MAX_ROWS)  # the tiles, whatever an earlier engine measured
    try:
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16()
            ms = fastest_ms([*(tiles(x, d) for d in dots), lambda: kernels.quant_linear(x, *args, 2)], reps)
            timings.append((m, dict(zip(dots, ms[:-1])), ms[-1]))
    finally:
        if len(dots) > 1:
            kernels.set_quant_tile_dot(0)
        if hasattr(kernels, "set_quant_panel_max_rows"):
            kernels.set_quant_panel_max_rows(panels_before)
    dot, rows_max, dot_from = tile_dot(timings)
    panels = time_panels(kernels, [m for m in rows if m <= PANEL_ROWS], PANEL_REPS_FACTOR * reps, (layer, gen))
    routing = QuantRouting(rows_max, "measured", cpu_has_amx(), dot, dot_from, tuple(timings),
                           min(crossover(panels, PANEL_MARGIN), rows_max), tuple(panels))
    apply(kernels, routing)
    return routing


def time_panels(kernels: ModuleType, rows: Sequence[int], reps: int = PANEL_REPS_FACTOR * ROUTE_REPS,
                synthetic: tuple[Int4Linear, torch.Generator] | None = None) -> list[tuple[int, float, float]]:
    """(rows, panels ms, tiles ms) on the synthetic layer (`synthetic`: calibrate's, else made here): int4's
    few-row kernel in panels against the fastest of the tiles' usable dots, at each count;
    `crossover(..., PANEL_MARGIN)` of it is where the panels stop winning by the margin."""
    if not hasattr(kernels, "set_quant_panel_max_rows"):
        return []
    layer, gen = synthetic or _synthetic_layer()
    args = (layer.codes, layer.scales, layer.mins, layer.bits, None)
    dots = dots_available(kernels)
    before = (kernels.quant_panel_max_rows(), kernels.quant_tile_dot(), kernels.quant_tile_dot_from())
    out = []
    try:
        kernels.set_quant_tile_dot_from(0)
        for m in rows:
            x = torch.randn(m, layer.in_features, generator=gen).bfloat16()

            def call(panel_max: int, dot: int, x: torch.Tensor = x) -> Callable[[], object]:
                def run() -> object:
                    kernels.set_quant_panel_max_rows(panel_max)
                    if len(dots) > 1:
                        kernels.set_quant_tile_dot(dot)
                    return kernels.quant_linear(x, *args, 1)
                return run

            ms = fastest_ms([call(m, 0), *(call(SKINNY_MAX_ROWS, DOTS.index(d)) for d in dots)], reps)
            out.append((m, ms[0], min(ms[1:])))
    finally:
        kernels.set_quant_panel_max_rows(before[0])
        if len(dots) > 1:
            kernels.set_quant_tile_dot(before[1])
        kernels.set_quant_tile_dot_from(before[2])
    return out


def _synthetic_layer() -> tuple[Int4Linear, torch.Generator]:
    """The layer the routes are timed on (_SHAPE, int4 in groups of 32) and a generator for its x."""
    from tokenloom.quant.linear import Int4Linear
    from tokenloom.quant.quantizers import quantize_int4

    n, k = _SHAPE
    gen = torch.Generator().manual_seed(0)
    return Int4Linear.from_codes(*quantize_int4(torch.randn(n, k, generator=gen) * 0.05, 32)), gen


def apply(kernels: ModuleType, routing: QuantRouting) -> None:
    """Set the crossovers and the tiles' dot in the kernel module (process-wide)."""
    kernels.set_quant_tile_max_rows(routing.tile_max_rows)
    if hasattr(kernels, "set_quant_panel_max_rows"):
        kernels.set_quant_panel_max_rows(routing.panel_max_rows)
    if hasattr(kernels, "set_quant_tile_dot"):
        kernels.set_quant_tile_dot(DOTS.index(routing.tile_dot))
        kernels.set_quant_tile_dot_from(routing.tile_dot_from)


def calibration_rows(max_rows: int) -> tuple[int, ...]:
    """The counts of CALIBRATION_ROWS up to the first that covers a step of `max_rows` rows (all of them
    for budgets past the largest: calls beyond it take the expansion, unmeasured)."""
    covered = [r for r in CALIBRATION_ROWS if r < max_rows]
    return tuple(covered + [r for r in CALIBRATION_ROWS if r >= max_rows][:1])


@functools.cache
def measured(kernels: ModuleType, max_rows: int) -> QuantRouting:
    """`calibrate` once per process, kernel module and step budget."""
    return calibrate(kernels, calibration_rows(max_rows))


@functools.cache
def measured_panels(kernels: ModuleType) -> tuple[tuple[int, float, float], ...]:
    """`time_panels` once per process and kernel module, at the calibration counts up to PANEL_ROWS."""
    return tuple(time_panels(kernels, [m for m in CALIBRATION_ROWS if m <= PANEL_ROWS]))


def choose(kernels: ModuleType, tile_max_rows: int | None, max_rows: int) -> QuantRouting:
    """Set the crossover: `tile_max_rows` as given (--quant-tile-max-rows; the tiles' dot still measured
    where AMX is available, and int4's panels against the tiles), else measured up to a step of `max_rows`
    rows (the engine's --max-num-batched-tokens); logged."""
    if tile_max_rows is None:
        routing = measured(kernels, max_rows)
    else:
        if tile_max_rows < SKINNY_MAX_ROWS:
            raise ConfigError(f"--quant-tile-max-rows must be at least {SKINNY_MAX_ROWS}, got {tile_max_rows}")
        dot, dot_from = "vnni", 0  # the only dot without AMX: nothing to time
        panels = None
        if len(dots_available(kernels)) > 1:  # the dot is still measured where there is a choice (AMX)
            m = measured(kernels, max_rows)
            dot, dot_from, panels = m.tile_dot, m.tile_dot_from, m.panel_timings
        if panels is None:  # below the tiles, whatever their crossover
            panels = measured_panels(kernels)
        routing = QuantRouting(tile_max_rows, "set", cpu_has_amx(), dot, dot_from,
                               panel_max_rows=min(crossover(panels, PANEL_MARGIN), tile_max_rows),
                               panel_timings=panels)
    apply(kernels, routing)
    log.info("%s", routing.describe())
    return routing
