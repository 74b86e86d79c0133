"""Prepacked weights (models/layers.py Linear.prepack, --prepack-weights): the oneDNN-blocked copy computes
x @ W.T to bfloat16 rounding, serves exactly the matmuls from past the skinny kernel's rows (1, or the
measured crossover of models/dense_routing.py) to PACKED_MAX_ROWS rows, and changes no token the engine
produces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenloom import LLM, SamplingParams
from tokenloom.cli import build_parser, engine_config
from tokenloom.kernels import load_cpu_kernels
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.models import dense_routing
from tokenloom.models.layers import PACKED_MAX_ROWS, Linear, prepack_available, prepackable

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN bfloat16 matmul here")

K = load_cpu_kernels()
SKINNY = K if K is not None and K.skinny_available() else None


def _linear(n: int, k: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(k, n, bias=bias).to(torch.bfloat16).requires_grad_(False)
    lin.kernels = SKINNY
    return lin


@pytest.mark.parametrize("rows", [2, 3, 8, 9, 64, PACKED_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(96, 64), (45, 100)])  # (out, in): blocked sizes and odd ones
def test_packed_matmul_matches_float32_reference(rows: int, bias: bool, shape: tuple[int, int]) -> None:
    lin = _linear(*shape, bias)
    assert lin.prepack(rows_hint=64) == lin.weight.numel() * 2
    x = torch.randn(rows, shape[1]).bfloat16()
    strided = torch.randn(rows, shape[1] + 7).bfloat16()[:, 3 : 3 + shape[1]]  # a non-contiguous view
    b = None if lin.bias is None else lin.bias.float()
    for inp in (x, strided):
        got = lin(inp)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
        # bf16 products are exact in float32: only the final rounding and the summation order differ.
        torch.testing.assert_close(got.float(), F.linear(inp.float(), lin.weight.float(), b), rtol=8e-3, atol=2e-2)


@pytest.mark.parametrize("skinny_rows", [1, SKINNY_MAX_ROWS])
def test_packed_copy_serves_the_rows_past_the_skinny_ones(skinny_rows: int) -> None:
    """Routing: give the packed copy a different weight and see which rows it answers. Up to the measured
    crossover (models/dense_routing.py; forced here) the skinny kernel answers from the plain weight."""
    if SKINNY is None and skinny_rows > 1:
        pytest.skip("the skinny kernel needs AVX512-BF16")
    before = Linear.skinny_rows_packed
    if SKINNY is not None:
        dense_routing.apply(K, skinny_rows)
    try:
        lin = _linear(64, 96, bias=False)
        other = torch.randn(64, 96).bfloat16()
        lin.packed = torch.ops.mkldnn._reorder_linear_weight(other, 16)
        x = torch.randn(PACKED_MAX_ROWS + 1, 96).bfloat16()
        for rows in (2, 5, 9, PACKED_MAX_ROWS):
            if rows <= skinny_rows:
                assert torch.equal(lin(x[:rows]), K.skinny_linear(x[:rows], lin.weight, None))
            else:
                torch.testing.assert_close(lin(x[:rows]), F.linear(x[:rows], other), rtol=8e-3, atol=2e-2)
        # One row: the skinny kernel (or F.linear) on the plain weight; more than PACKED_MAX_ROWS: F.linear.
        want = K.skinny_linear(x[:1], lin.weight, None) if SKINNY is not None else F.linear(x[:1], lin.weight)
        assert torch.equal(lin(x[:1]), want)
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    finally:
        if SKINNY is not None:
            dense_routing.apply(K, before)


def test_prepacking_packs_every_dense_bf16_layer(tiny_llama: Path) -> None:
    on = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256)
    layers = [m for m in on.engine.loaded.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.packed is not None for m in layers)
    off = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256, prepack_weights=False)
    assert all(m.packed is None for m in off.engine.loaded.model.modules() if isinstance(m, Linear))
    f32 = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    assert all(m.packed is None for m in f32.engine.loaded.model.modules() if isinstance(m, Linear))
    assert prepackable(f32.engine.loaded.model) == []  # float32 layers are left alone


def test_prepacked_engine_gives_the_same_tokens(tiny_llama: Path) -> None:
    prompts = ["the cat sat on the mat", "a", "one two three four five six seven eight nine ten", "hello world"] * 3
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    runs = [LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256, block_size=4,
                prepack_weights=p).generate(prompts, params) for p in (True, False)]
    for a, b in zip(*runs):
        # Without the packed copy, 2..8-row matmuls run the skinny kernel: the same products summed in
        # another order, so logprobs agree to bfloat16 rounding rather than bit for bit.
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=0.05)


def test_cli_flag() -> None:
    p = build_parser()
    assert engine_config(p.parse_args(["generate", "hi"])).prepack_weights is True
    assert engine_config(p.parse_args(["generate", "hi", "--no-prepack-weights"])).prepack_weights is False


def test_no_prepacking_when_the_copy_would_crowd_memory(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    import tokenloom.engine.builder as engine_mod

    dense = sum(m.weight.numel() * 2 for m in LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB",
                                                    prepack_weights=False).engine.loaded.model.modules()
                if isinstance(m, Linear))
    monkeypatch.setattr(engine_mod, "free_memory_bytes", lambda device: 2 * dense - 2)  # the copy > half of it
    with caplog.at_level("WARNING", logger="tokenloom.engine"):
        llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256)
    assert all(m.packed is None for m in llm.engine.loaded.model.modules() if isinstance(m, Linear))
    assert "not prepacking" in caplog.text
