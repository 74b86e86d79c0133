"""The quantized tiles dotted by AMX (csrc/qtile_amx.h) against the same tiles dotted by vpdpbusd
(csrc/qtile.h), which tests/test_quant_routes.py and tests/test_kquant.py hold to the float reference and
to the exact model of their int8 arithmetic. AMX-INT8 must give the same bf16 outputs bit for bit; AMX-BF16
(the tile decoded to bf16, x not quantized) is held to the float reference within the expand route's
bound (the weight rounded to bf16 once, bf16 output), for every format the tiles serve, at every batched
row count (whole and partial blocks of 16 rows, one or two per pass) and at prefill sizes. The AMX dots run
only on a CPU that has AMX (no CPU without it can execute the instructions); elsewhere those tests skip
and the rule that picks the dot (quant/routing.py) and the refusal to turn AMX on are still checked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from test_kquant import _layer
from test_quant_routes import _layers

from tokenloom.kernels import load_quant_kernels
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.quant import routing

KERNELS = load_quant_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="needs the AVX512 quantized kernels")
AMX = KERNELS is not None and "amx-int8" in KERNELS.quant_tile_dots()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU (or its kernel) gives no AMX")

ROWS = [*range(SKINNY_MAX_ROWS + 1, 65), 100, 257]  # the tiles' counts: 9..64 (1-4 blocks of 16, partial ones), prefill
Q = GGMLQuantizationType
VNNI, INT8, BF16 = (routing.DOTS.index(d) for d in ("vnni", "amx-int8", "amx-bf16"))


@pytest.fixture
def restore_dot() -> Iterator[None]:
    before, start = KERNELS.quant_tile_dot(), KERNELS.quant_tile_dot_from()
    KERNELS.set_quant_tile_dot_from(0)
    yield
    KERNELS.set_quant_tile_dot(before)
    KERNELS.set_quant_tile_dot_from(start)


def _dots(layer: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for dot in (VNNI, INT8, BF16):
        KERNELS.set_quant_tile_dot(dot)
        out.append(layer(x))
    return out


def _assert_bf16_dot(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # the expand route's bound (test_quant_routes.py): bf16 output rounding, the weight rounded to bf16 once
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().amax().item(), msg=what)


@needs_amx
@pytest.mark.usefixtures("restore_dot")
@pytest.mark.parametrize("name", list(_layers()))
def test_amx_dots_at_every_row_count(name: str) -> None:
    """int8 per channel (one long group), Q8_0, Q4_1, Q4_0, int4 g64 and g128 (long groups), with and
    without bias, through the forced tile route: AMX-INT8 equal to vpdpbusd, AMX-BF16 near the reference."""
    lin = _layers()[name]
    lin.route = "vnni"
    g = torch.Generator().manual_seed(3)
    for rows in ROWS:
        x = torch.randn(rows, lin.in_features, generator=g).bfloat16()
        vnni, int8, bf16 = _dots(lin, x)
        assert torch.equal(vnni, int8), f"{name}, {rows} rows: max diff {(vnni.float() - int8.float()).abs().max()}"
        _assert_bf16_dot(bf16, lin.reference(x), f"{name}, {rows} rows")


@needs_amx
@pytest.mark.usefixtures("restore_dot")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q5_0, Q.Q6_K], ids=lambda q: q.name)
def test_amx_dots_for_kquants(qtype: Q) -> None:
    """The K-quants and Q5_0 through the same tiles (Q6_K's integer sub-scales stay on vpdpbusd whatever
    the dot: checked so that choosing AMX never breaks them); K 768 and 608 (an odd count of 32-input
    spans: the lone last span), odd N (a partial tile)."""
    k = 608 if qtype == Q.Q5_0 else 768
    layer, want_w = _layer(qtype, 37, k, bias=True, seed=5)
    layer.route = "vnni"
    g = torch.Generator().manual_seed(4)
    for rows in (9, 16, 17, 33, 64, 100):
        x = torch.randn(rows, k, generator=g).bfloat16()
        vnni, int8, bf16 = _dots(layer, x)
        assert torch.equal(vnni, int8), f"{qtype.name}, {rows} rows"
        if qtype == Q.Q6_K:
            assert torch.equal(vnni, bf16), f"{qtype.name}, {rows} rows"
        else:
            _assert_bf16_dot(bf16, F.linear(x.float(), want_w, layer.bias.float()), f"{qtype.name}, {rows} rows")


@needs_amx
@pytest.mark.usefixtures("restore_dot")
def test_amx_in_parallel_tasks_and_after_onednn() -> None:
    """Each parallel task loads its tile configuration itself: two threads, and oneDNN's own AMX kernels
    (the expand route, bf16) run in between on the same threads, must not change a single output."""
    lin = _layers()["Q4_1"]
    x = torch.randn(64, lin.in_features, generator=torch.Generator().manual_seed(6)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        lin.route = "vnni"
        first = _dots(lin, x)
        lin.route = "expand"
        lin(x)
        lin.route = "vnni"
        again = _dots(lin, x)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and torch.equal(first[0], first[1])


def test_amx_cannot_be_chosen_where_it_is_unavailable(restore_dot: None) -> None:
    with pytest.raises(RuntimeError, match="0 \\(vnni\\)"):
        KERNELS.set_quant_tile_dot(3)
    if AMX:
        assert KERNELS.quant_tile_dots() == list(routing.DOTS)
        KERNELS.set_quant_tile_dot(BF16)
        assert KERNELS.quant_tile_dot() == BF16
    else:
        assert KERNELS.quant_tile_dots() == ["vnni"]
        for dot in (INT8, BF16):
            with pytest.raises(RuntimeError, match="AMX"):
                KERNELS.set_quant_tile_dot(dot)
        assert KERNELS.quant_tile_dot() == VNNI


def test_the_dot_that_beats_the_expansion_longest_wins() -> None:
    def t(*rows: tuple[int, float, float, float, float]) -> list[tuple[int, dict[str, float], float]]:
        return [(m, {"vnni": v, "amx-int8": a, "amx-bf16": b}, e) for m, v, a, b, e in rows]

    # amx-bf16 ahead of the expansion to 128 rows, the others to 32; faster than vnni at every count
    assert routing.tile_dot(t((16, 1.0, 0.9, 0.5, 2.0), (32, 2.0, 1.8, 1.0, 2.5), (128, 8.0, 7.0, 3.0, 4.0),
                              (256, 16.0, 14.0, 6.0, 5.0))) == ("amx-bf16", 128, 0)
    # ... slower than vnni at 16 rows: vnni below 32
    assert routing.tile_dot(t((16, 1.0, 0.9, 1.5, 2.0), (32, 2.0, 1.8, 1.0, 2.5), (128, 8.0, 7.0, 3.0, 4.0),
                              (256, 16.0, 14.0, 6.0, 5.0))) == ("amx-bf16", 128, 32)
    # ... slower than vnni wherever vnni still beats the expansion: from past vnni's reach
    assert routing.tile_dot(t((16, 1.0, 0.9, 1.5, 2.0), (32, 2.0, 1.8, 2.1, 2.5), (128, 8.0, 7.0, 3.0, 4.0),
                              (256, 16.0, 14.0, 6.0, 5.0))) == ("amx-bf16", 128, 128)
    # the same reach: the fastest at the first count
    assert routing.tile_dot(t((16, 1.0, 0.9, 0.95, 2.0), (32, 2.0, 2.1, 2.2, 2.5))) == ("amx-int8", 32, 33)
    assert routing.tile_dot(t((16, 0.8, 0.9, 0.95, 2.0), (32, 2.0, 2.1, 2.2, 2.5))) == ("vnni", 32, 0)
    # vnni alone (no AMX)
    assert routing.tile_dot([(16, {"vnni": 1.0}, 2.0), (32, {"vnni": 3.0}, 2.5)]) == ("vnni", 16, 0)
    assert routing.tile_dot([]) == ("vnni", SKINNY_MAX_ROWS, 0)


@needs_amx
@pytest.mark.usefixtures("restore_dot")
def test_vnni_below_the_dots_first_row_count() -> None:
    """Below quant_tile_dot_from the tiles take vpdpbusd whatever the dot (bit for bit), from it the dot."""
    lin = _layers()["Q4_1"]
    lin.route = "vnni"
    x = torch.randn(40, lin.in_features, generator=torch.Generator().manual_seed(7)).bfloat16()
    KERNELS.set_quant_tile_dot(VNNI)
    vnni = lin(x)
    KERNELS.set_quant_tile_dot(BF16)
    bf16 = lin(x)
    KERNELS.set_quant_tile_dot_from(41)
    assert torch.equal(lin(x), vnni)
    KERNELS.set_quant_tile_dot_from(40)
    assert torch.equal(lin(x), bf16) and not torch.equal(bf16, vnni)
