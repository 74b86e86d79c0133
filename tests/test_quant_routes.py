"""The quantized matmuls' routes at every batch size: int8-activation VNNI kernels (few rows, int4's in
panels past SKINNY_MAX_ROWS, then the cache-resident tiles of csrc/qtile.h) and the weight expanded to bf16
for oneDNN, each forced on this CPU whatever it has, against the float reference and against the exact
model of their arithmetic; and the start-up choice between them (quant/routing.py)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_quant import _few_rows_int4_oracle, _few_rows_int8_oracle, _tile_min_rows

from tokenloom import LLM
from tokenloom.errors import ConfigError
from tokenloom.kernels import load_quant_kernels
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.quant import routing
from tokenloom.quant.linear import Int4Linear, Int8Linear, QuantLinear
from tokenloom.quant.quantizers import quantize_int4, quantize_int8

KERNELS = load_quant_kernels()
pytestmark = [pytest.mark.skipif(KERNELS is None, reason="needs the AVX512 quantized kernels"),
              pytest.mark.usefixtures("vnni_tiles")]  # the int8-x arithmetic (AMX dots: test_quant_amx.py)

ROWS = [*range(1, 65), 100, 257]  # every batched-decode size to 64, then prefill-sized calls
N, K = 45, 256  # 45 outputs: two full 16-channel tiles and a partial one (a pair of tiles, then one alone)


def _layers() -> dict[str, QuantLinear]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.05
    bias = torch.randn(N, generator=g).bfloat16()
    q4, d4, m4 = quantize_int4(w, 32)
    blocks = w.reshape(N, K // 32, 32)
    d8 = blocks.abs().amax(-1) / 127
    q8 = torch.round(blocks / d8[..., None]).clamp(-127, 127).to(torch.int8).reshape(N, K)
    d40 = (blocks.abs().amax(-1) / 8).half()  # GGUF Q4_0: w = d (q - 8)
    q40 = torch.clamp(torch.round(blocks / d40.float()[..., None]) + 8, 0, 15).reshape(N, K)
    return {
        "int8 per channel": Int8Linear.from_codes(*quantize_int8(w), bias),
        "Q8_0": Int8Linear.from_codes(q8, d8.half()),
        "Q4_1": Int4Linear.from_codes(q4, d4, m4, bias),
        "Q4_0": Int4Linear.from_codes(q40, d40, -8 * d40),
        "int4 g64": Int4Linear.from_codes(*quantize_int4(w, 64)),
        "int4 g128": Int4Linear.from_codes(*quantize_int4(w, 128), bias),
    }


@pytest.fixture
def restore_tile_max_rows() -> Iterator[None]:
    before, dot, start = KERNELS.quant_tile_max_rows(), KERNELS.quant_tile_dot(), KERNELS.quant_tile_dot_from()
    panels = KERNELS.quant_panel_max_rows()
    yield
    KERNELS.set_quant_tile_max_rows(before)
    KERNELS.set_quant_tile_dot(dot)
    KERNELS.set_quant_tile_dot_from(start)
    KERNELS.set_quant_panel_max_rows(panels)


@pytest.mark.usefixtures("restore_tile_max_rows")
@pytest.mark.parametrize("name", list(_layers()))
def test_every_route_at_every_row_count(name: str) -> None:
    """1..64 rows and two prefill sizes: the expand route to the float reference within the bound the
    kernels are held to (bf16 output rounding, the weight rounded to bf16 once); the vnni route to the exact
    model of its int8-x arithmetic within bf16 output rounding, and to the float reference in norm. int4's
    vnni route twice: its few-row kernel handing over to the tiles at SKINNY_MAX_ROWS + 1 rows, and kept in
    panels to 64 rows (where the start-up measurement puts that crossover depends on the CPU)."""
    lin = _layers()[name]
    KERNELS.set_quant_tile_max_rows(4096)  # vnni as forced; expand is forced below at every count anyway
    for panels in ((SKINNY_MAX_ROWS, 64) if lin.bits == 4 else (SKINNY_MAX_ROWS,)):
        KERNELS.set_quant_panel_max_rows(panels)
        g = torch.Generator().manual_seed(1)
        for rows in ROWS:
            x = torch.randn(rows, K, generator=g).bfloat16()
            want = lin.reference(x)
            scale = want.abs().amax().item()
            lin.route = "expand"
            torch.testing.assert_close(lin(x).float(), want, rtol=8e-3, atol=8e-3 * scale, msg=f"expand, {rows} rows")
            lin.route = "vnni"
            got = lin(x).double()
            # int8's few-row kernel quantizes x per 64-input chunk in the codes' order; the tiles and int4's
            # few-row kernel per 32 inputs in natural order (test_quant.py's models of each)
            rows_apart = lin.bits == 8 and rows < _tile_min_rows(lin)
            model = _few_rows_int8_oracle(lin, x) if rows_apart else _few_rows_int4_oracle(lin, x)
            msg = f"vnni, {rows} rows, panels to {panels}"
            torch.testing.assert_close(got, model, rtol=2**-8, atol=1e-4 * scale, msg=msg)
            assert (got - want.double()).norm() <= 8e-3 * want.double().norm(), msg


def test_int8_hands_over_to_the_tiles_where_measured() -> None:
    """The first row count of int8's tiles (quant_gemm.cpp int8_tile_min_rows, measured on Zen 4): per
    channel from 4 rows, Q8_0's groups of 32 from 7, other group sizes past the few-row kernel's last; the
    outputs follow the tiles' arithmetic (x per 32 inputs) from there and the few-row kernel's (per 64-input
    chunk) below, which differ on an input that coarsens its chunk's step."""
    layers = _layers()
    assert _tile_min_rows(layers["int8 per channel"]) == 4
    assert _tile_min_rows(layers["Q8_0"]) == 7
    assert KERNELS.quant_tile_min_rows(8, 4, 64) == SKINNY_MAX_ROWS + 1
    assert KERNELS.quant_tile_min_rows(4, 8, 32) == KERNELS.quant_panel_max_rows() + 1
    with pytest.raises(RuntimeError, match="bits"):
        KERNELS.quant_tile_min_rows(5, 1, 32)
    for name in ("int8 per channel", "Q8_0"):
        lin = layers[name]
        lin.route = "vnni"
        first = _tile_min_rows(lin)
        for rows, tiles in ((first - 1, False), (first, True)):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(3)).bfloat16()
            x[:, 40] = 30.0  # its 32-input block's step is coarse; the other half of its 64-input chunk's is not
            got = lin(x).double()
            scale = got.abs().max().item()
            tol = dict(rtol=2**-8, atol=1e-4 * scale)
            by_32, by_64 = _few_rows_int4_oracle(lin, x), _few_rows_int8_oracle(lin, x)
            torch.testing.assert_close(got, by_32 if tiles else by_64, **tol, msg=f"{name}, {rows} rows")
            assert not torch.allclose(got, by_64 if tiles else by_32, **tol), f"{name}, {rows} rows"


@pytest.mark.usefixtures("restore_tile_max_rows")
def test_int4_panels_give_each_row_what_one_row_gives() -> None:
    """The few-row kernel in panels: every row's outputs bit for bit those of a call with that row alone,
    whichever panel it falls in, for each int4 layout (groups of 32, 64, 128, Q4_0's zero point, a bias,
    a partial last block of channels)."""
    KERNELS.set_quant_tile_max_rows(4096)
    KERNELS.set_quant_panel_max_rows(64)
    g = torch.Generator().manual_seed(4)
    for name, lin in _layers().items():
        if lin.bits != 4:
            continue
        lin.route = "vnni"
        for rows in (SKINNY_MAX_ROWS + 1, 13, 16, 23, 40, 64):
            x = torch.randn(rows, K, generator=g).bfloat16()
            alone = torch.cat([lin(x[i:i + 1]) for i in range(rows)])
            assert torch.equal(lin(x), alone), (name, rows)


@pytest.mark.usefixtures("restore_tile_max_rows")
def test_auto_route_follows_the_panel_crossover() -> None:
    """Up to quant_panel_max_rows rows int4 keeps the few-row kernel (bit for bit its rows alone), past it
    the tiles; int8 does not look at it."""
    KERNELS.set_quant_tile_max_rows(4096)
    KERNELS.set_quant_panel_max_rows(16)
    assert KERNELS.quant_panel_max_rows() == 16
    lin, q8 = _layers()["Q4_1"], _layers()["Q8_0"]
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(5)).bfloat16()
    x[:, 7] = 25.0
    alone = torch.cat([lin(x[i:i + 1]) for i in range(17)])
    assert torch.equal(lin(x[:16]), alone[:16])
    KERNELS.set_quant_panel_max_rows(64)
    assert torch.equal(lin(x), alone)
    KERNELS.set_quant_panel_max_rows(SKINNY_MAX_ROWS)
    tiles16 = lin(x[:16])
    KERNELS.set_quant_panel_max_rows(16)
    assert torch.equal(lin(x[:17])[:16], tiles16)  # 17 rows: the tiles
    assert not torch.equal(tiles16, alone[:16])  # (so the comparisons above tell the two apart)
    q8_tiles = q8(x[:16])
    KERNELS.set_quant_panel_max_rows(64)
    assert torch.equal(q8(x[:16]), q8_tiles)
    with pytest.raises(RuntimeError, match="at least"):
        KERNELS.set_quant_panel_max_rows(SKINNY_MAX_ROWS - 1)


def test_tiles_are_their_int8_arithmetic_not_float_x() -> None:
    """An outlier input coarsens its 32 neighbours' step: the tiles must follow the int8-x model, which then
    differs from float x by more than the model's tolerance (so the model is what is being checked)."""
    for name, lin in _layers().items():
        lin.route = "vnni"
        x = torch.randn(24, K, generator=torch.Generator().manual_seed(2)).bfloat16()
        x[:, 5] = 40.0
        got, model = lin(x).double(), _few_rows_int4_oracle(lin, x)
        tol = dict(rtol=2**-8, atol=1e-4 * model.abs().max().item())
        torch.testing.assert_close(got, model, **tol, msg=name)
        assert not torch.allclose(got, lin.reference(x).double(), **tol), name


@pytest.mark.usefixtures("restore_tile_max_rows")
def test_auto_route_follows_the_crossover() -> None:
    """auto takes vnni up to quant_tile_max_rows rows and the expansion beyond: bit for bit the forced route."""
    lin = _layers()["Q4_1"]
    KERNELS.set_quant_tile_max_rows(16)
    for rows, route in ((8, "vnni"), (16, "vnni"), (17, "expand"), (64, "expand")):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).bfloat16()
        lin.route = route
        forced = lin(x)
        lin.route = "auto"
        assert torch.equal(lin(x), forced), (rows, route)
    with pytest.raises(RuntimeError, match="at least"):
        KERNELS.set_quant_tile_max_rows(SKINNY_MAX_ROWS - 1)
    with pytest.raises(ConfigError, match="route"):
        lin.route = "amx"


def test_crossover_is_where_the_tiles_stop_winning() -> None:
    assert routing.crossover([(16, 1.0, 2.0), (32, 2.0, 2.5), (64, 4.0, 3.0), (128, 5.0, 6.0)]) == 32
    assert routing.crossover([(16, 3.0, 2.0), (32, 1.0, 2.0)]) == SKINNY_MAX_ROWS  # lost at the first count
    assert routing.crossover([(16, 1.0, 2.0), (256, 1.0, 1.0)]) == 256  # a tie keeps the tiles
    # with a margin the first route must win by it: int4's panels against the tiles (PANEL_MARGIN)
    panels = [(16, 0.116, 0.132), (32, 0.229, 0.237), (64, 0.455, 0.442)]  # the 2-core EPYC's start-up
    assert routing.crossover(panels) == 32 and routing.crossover(panels, routing.PANEL_MARGIN) == 16
    assert routing.crossover([(16, 0.96, 1.0)], 0.95) == SKINNY_MAX_ROWS


def test_calibration_keeps_each_route_fastest_call_through_a_burst() -> None:
    """A burst of interference over half the calls of one route (as a server still exiting at start-up
    once caused) must not hand the choice to the other: a median would (15 ms against 5), the fastest not."""
    calls = {"a": 0}

    def burst_then_fast() -> None:
        calls["a"] += 1
        time.sleep(0.03 if calls["a"] <= 4 else 0.0)  # the warm-up call and 3 of 6 timed calls are slow

    a, b = routing.fastest_ms([burst_then_fast, lambda: time.sleep(0.005)], reps=6)
    assert calls["a"] == 7 and a < 5.0 <= b


def test_calibration_reaches_a_served_step() -> None:
    """A served step's linears see up to --max-num-batched-tokens rows (a prompt's chunk beside the decode
    rows). Counts past the largest measured go to the expansion unmeasured, so the counts timed must reach
    the budget (the default 512 among them), and stop there (each larger count costs start-up time)."""
    from tokenloom.config import EngineConfig

    default_budget = EngineConfig.__dataclass_fields__["max_num_batched_tokens"].default
    assert list(routing.CALIBRATION_ROWS) == sorted(routing.CALIBRATION_ROWS)
    assert routing.calibration_rows(default_budget) == tuple(r for r in routing.CALIBRATION_ROWS if r <= 512)
    assert routing.calibration_rows(600)[-2:] == (512, 1024)  # the first count covering 600 rows
    assert routing.calibration_rows(16) == (16,) and routing.calibration_rows(1) == (16,)
    assert routing.calibration_rows(2048) == routing.calibration_rows(10**6) == routing.CALIBRATION_ROWS


@pytest.mark.usefixtures("restore_tile_max_rows")
def test_calibration_times_both_routes_and_sets_the_kernel() -> None:
    r = routing.calibrate(KERNELS, rows=(16, 32), reps=2)
    dots = KERNELS.quant_tile_dots()  # every usable dot is timed (AMX's two only where they can run)
    assert [m for m, _, _ in r.timings] == [16, 32] and all(list(d) == dots for _, d, _ in r.timings)
    assert all(t > 0 and e > 0 for _, d, e in r.timings for t in d.values())
    assert (r.tile_dot, r.tile_max_rows, r.tile_dot_from) == routing.tile_dot(r.timings)
    assert r.tile_max_rows == KERNELS.quant_tile_max_rows()
    assert routing.DOTS.index(r.tile_dot) == KERNELS.quant_tile_dot()
    if len(dots) > 1:
        assert r.tile_dot_from == KERNELS.quant_tile_dot_from()
    assert r.source == "measured" and "measured" in r.describe() and "16 rows" in r.describe()
    # int4's panels against the tiles at the counts measured up to PANEL_ROWS, kept where they won
    assert [m for m, _, _ in r.panel_timings] == [16, 32]
    assert all(p > 0 and t > 0 for _, p, t in r.panel_timings)
    assert r.panel_max_rows == min(routing.crossover(r.panel_timings, routing.PANEL_MARGIN), r.tile_max_rows)
    assert r.panel_max_rows == KERNELS.quant_panel_max_rows()
    if r.panel_max_rows > SKINNY_MAX_ROWS:
        assert f"int4 in panels of {SKINNY_MAX_ROWS} up to {r.panel_max_rows}" in r.describe()
    assert f"tiles dotted by {r.tile_dot}" in r.describe()
    assert f"up to {r.tile_max_rows} rows, W expanded to bf16 for oneDNN beyond" in r.describe()


@pytest.mark.usefixtures("restore_tile_max_rows")
def test_calibration_times_the_tiles_whatever_the_panels_were() -> None:
    """A process that measured before (another engine, another budget) may have left int4's panels on up to
    64 rows: the next measurement's tile timings must still be the tiles' (each call sees panels off)."""
    seen = []
    real = KERNELS.quant_linear

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(KERNELS, name)

        def quant_linear(self, x: torch.Tensor, *args: object) -> torch.Tensor:
            seen.append((x.shape[0], args[-1], KERNELS.quant_panel_max_rows()))
            return real(x, *args)

    KERNELS.set_quant_panel_max_rows(64)
    routing.calibrate(Spy(), rows=(16, 32), reps=1)
    first_panel_call = next(i for i, (m, route, panels) in enumerate(seen) if route == 1 and panels >= m)
    tiles_phase = seen[:first_panel_call]
    assert tiles_phase and all(panels == SKINNY_MAX_ROWS for _, _, panels in tiles_phase)


@pytest.mark.usefixtures("restore_tile_max_rows")
def test_engine_start_up_sets_and_logs_the_routing(smollm2_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The default model (Q4_1 kept quantized) logs the choice; --quant-tile-max-rows sets it instead."""
    with caplog.at_level(logging.INFO, logger="tokenloom.quant"):
        llm = LLM(model=str(smollm2_gguf), max_model_len=128, kv_cache_memory="16MiB", quant_tile_max_rows=32)
    assert KERNELS.quant_tile_max_rows() == 32
    routing = llm.engine.quant_routing  # what `tokenloom serve` prints beside the KV capacity line
    assert routing is not None and (routing.tile_max_rows, routing.source) == (32, "set")
    assert any("up to 32 rows, W expanded" in r.getMessage() and "(set;" in r.getMessage() for r in caplog.records)
    # int4's panels measured all the same, and never past the tiles' crossover that was set
    assert routing.panel_max_rows <= 32 and routing.panel_max_rows == KERNELS.quant_panel_max_rows()
    assert [m for m, _, _ in routing.panel_timings] == [16, 32, 64]
    with pytest.raises(ConfigError, match="quant-tile-max-rows"):
        LLM(model=str(smollm2_gguf), quant_tile_max_rows=4)
