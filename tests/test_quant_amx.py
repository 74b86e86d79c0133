"""The quantized tiles dotted by AMX-INT8 (csrc/qtile_amx.h) against the same tiles dotted by vpdpbusd
(csrc/qtile.h), which tests/test_quant_routes.py and tests/test_kquant.py hold to the float reference and
to the exact model of their int8 arithmetic: AMX must give the same bf16 outputs bit for bit, for every
format the tiles serve, at every batched row count (whole and partial blocks of 16 rows) and at prefill
sizes. The AMX route runs only on a CPU that has AMX-INT8 (no CPU without it can execute the instructions);
elsewhere those tests skip and the rule that picks the dot (quant/routing.py) and the refusal to turn AMX
on are still checked."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from gguf import GGMLQuantizationType
from test_kquant import _layer
from test_quant_routes import _layers

from tokenloom.kernels import load_quant_kernels
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.quant import routing

KERNELS = load_quant_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="needs the AVX512 quantized kernels")
AMX = KERNELS is not None and KERNELS.quant_tile_amx_available()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU (or its kernel) gives no AMX-INT8")

ROWS = [*range(SKINNY_MAX_ROWS + 1, 65), 100, 257]  # the tiles' counts: 9..64 (1-4 blocks of 16, partial ones), prefill
Q = GGMLQuantizationType


@pytest.fixture
def restore_dot() -> Iterator[None]:
    before = KERNELS.quant_tile_amx()
    yield
    KERNELS.set_quant_tile_amx(before)


def _both(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    KERNELS.set_quant_tile_amx(False)
    vnni = layer(x)
    KERNELS.set_quant_tile_amx(True)
    return vnni, layer(x)


@needs_amx
@pytest.mark.usefixtures("restore_dot")
@pytest.mark.parametrize("name", list(_layers()))
def test_amx_tiles_equal_the_vnni_tiles(name: str) -> None:
    """int8 per channel (one long group), Q8_0, Q4_1, Q4_0, int4 g64 and g128 (long groups), with and
    without bias: the forced tile route, AMX against vpdpbusd."""
    lin = _layers()[name]
    lin.route = "vnni"
    g = torch.Generator().manual_seed(3)
    for rows in ROWS:
        x = torch.randn(rows, lin.in_features, generator=g).bfloat16()
        vnni, amx = _both(lin, x)
        assert torch.equal(vnni, amx), f"{name}, {rows} rows: max diff {(vnni.float() - amx.float()).abs().max()}"


@needs_amx
@pytest.mark.usefixtures("restore_dot")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q5_0, Q.Q6_K], ids=lambda q: q.name)
def test_amx_tiles_equal_the_vnni_tiles_for_kquants(qtype: Q) -> None:
    """The K-quants and Q5_0 through the same tiles (Q6_K's integer sub-scales stay on vpdpbusd: equal
    trivially, checked so that turning AMX on never breaks them); K 768 and 608 (an odd count of 32-input
    spans: the lone last span), odd N (a partial tile)."""
    k = 608 if qtype == Q.Q5_0 else 768
    layer, _ = _layer(qtype, 37, k, bias=True, seed=5)
    layer.route = "vnni"
    g = torch.Generator().manual_seed(4)
    for rows in (9, 16, 17, 33, 64, 100):
        x = torch.randn(rows, k, generator=g).bfloat16()
        vnni, amx = _both(layer, x)
        assert torch.equal(vnni, amx), f"{qtype.name}, {rows} rows"


@needs_amx
@pytest.mark.usefixtures("restore_dot")
def test_amx_tiles_in_parallel_tasks_and_after_onednn() -> None:
    """Each parallel task loads the tile configuration itself: two threads, and oneDNN's own AMX kernels
    (the expand route, bf16) run in between on the same threads, must not change a single output."""
    lin = _layers()["Q4_1"]
    x = torch.randn(64, lin.in_features, generator=torch.Generator().manual_seed(6)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        lin.route = "vnni"
        vnni, amx = _both(lin, x)
        lin.route = "expand"
        lin(x)
        lin.route = "vnni"
        again = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(vnni, amx) and torch.equal(amx, again)


def test_amx_cannot_be_turned_on_where_it_is_unavailable(restore_dot: None) -> None:
    if AMX:
        KERNELS.set_quant_tile_amx(True)
        assert KERNELS.quant_tile_amx()
    else:
        with pytest.raises(RuntimeError, match="AMX"):
            KERNELS.set_quant_tile_amx(True)
        assert not KERNELS.quant_tile_amx()


def test_the_dot_that_beats_the_expansion_longer_wins() -> None:
    nan = math.nan
    # AMX ahead of the expansion to 64 rows, VNNI to 32: AMX, crossover 64
    assert routing.tile_dot([(16, 1.0, 0.5, 2.0), (32, 2.0, 1.0, 2.0), (64, 4.0, 2.0, 3.0), (128, 8.0, 4.0, 3.5)]) == (True, 64)
    # VNNI ahead longer
    assert routing.tile_dot([(16, 1.0, 0.9, 2.0), (32, 2.0, 3.0, 2.5)]) == (False, 32)
    # the same crossover: the faster at 16 rows
    assert routing.tile_dot([(16, 1.0, 0.9, 2.0), (32, 2.0, 2.1, 2.5)]) == (True, 32)
    assert routing.tile_dot([(16, 0.9, 1.0, 2.0), (32, 2.0, 1.5, 2.5)]) == (False, 32)
    # not measured (no AMX): VNNI
    assert routing.tile_dot([(16, 1.0, nan, 2.0), (32, 2.0, nan, 2.5)]) == (False, 32)
    assert routing.tile_dot([]) == (False, SKINNY_MAX_ROWS)
