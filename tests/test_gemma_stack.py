"""The fused decode step for Gemma (kernels/csrc/gemma_stack.cpp through engine/fused_decode.py) against its
oracle, the Python Gemma model with the same kernels: bit-identical hidden states on every step the stack
serves, and the same tokens and logprobs from the engine, for Gemma 3 (sliding and global layers, each kind
with its RoPE table, KV groups whose windowed blocks are released), Gemma 2 (attention soft-capping) and an
INT8 cache. GGUF layers kept quantized (K-quants, Q5_0 + Q8_0 parts) through the Llama stack as well."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from test_decode_stack import PROMPTS
from test_gemma3 import make_tiny_gemma
from test_kquant import _tiny_gemma_like_gguf
from tokenloom import LLM, SamplingParams
from tokenloom.engine.fused_decode import FusedDecoder
from tokenloom.kernels import load_cpu_kernels
from tokenloom.quant.kquant import KQuantLinear
from tokenloom.quant.parts import PartsLinear

K = load_cpu_kernels()
pytestmark = pytest.mark.skipif(K is None or not K.skinny_available() or not hasattr(K, "GemmaDecodeStack"),
                                reason="the fused decode step needs the C++ kernels with AVX512-BF16")

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (make_tiny_gemma arguments, engine options)
    "gemma3": ({}, {}),
    "gemma3 int8 kv cache": ({}, {"kv_cache_dtype": "int8"}),
    "gemma2 soft-capped": ({"arch": "gemma2", "attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0,
                            "layer_types": None}, {}),
}


def check_every_fused_step(llm: LLM) -> list[tuple[int, bool]]:
    """Runs each step the stack serves through the Python model too; returns (rows, equal) per step."""
    runner = llm.engine.runner
    inner = runner.fused.forward
    served: list[tuple[int, bool]] = []

    def checked(input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        got = inner(input_ids, positions, meta)
        want = runner.model(input_ids, positions, runner.kv_caches, meta)  # rewrites the same K/V: no change
        served.append((input_ids.numel(), torch.equal(got, want)))
        return got

    runner.fused.forward = checked  # type: ignore[method-assign]
    return served


def _llm(model: str, fused: bool, **kw: Any) -> LLM:
    return LLM(model, dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256, block_size=4,
               fused_decode=fused, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_gemma_stack_equals_the_python_model(tmp_path: Path, case: str) -> None:
    model_kw, engine_kw = CASES[case]
    folder = make_tiny_gemma(tmp_path / "m", seed=31, **model_kw)
    fused, plain = _llm(str(folder), True, **engine_kw), _llm(str(folder), False, **engine_kw)
    assert fused.engine.runner.fused is not None and plain.engine.runner.fused is None
    if model_kw.get("arch", "gemma3") == "gemma3":  # window 4, blocks of 4: the local layers have a KV group
        assert len({kv.group for kv in fused.engine.runner.kv_caches}) > 1
    served = check_every_fused_step(fused)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    got, want = fused.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert served and all(same for _, same in served)
    assert max(n for n, _ in served) > 8  # many-row steps (oneDNN) as well as single rows
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    fused.engine.kv.pool.check_invariants()


def test_gemma_stack_is_off_for_float32_and_names_why(tmp_path: Path) -> None:
    folder = make_tiny_gemma(tmp_path / "m", seed=32)
    f32 = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_model_len=128)
    assert f32.engine.runner.fused is None
    assert "bfloat16 only" in (FusedDecoder.supports(K, f32.engine.loaded.model, torch.device("cpu")) or "")


def test_kept_gguf_layers_run_in_the_llama_stack(tmp_path: Path) -> None:
    """K-quant layers and a PartsLinear (Q5_0 q/k + Q8_0 v) through FusedLinear.kquant / .concat: the same
    hidden states as the Python model's KQuantLinear / PartsLinear forwards."""
    if not KQuantLinear.kernel_routes():
        pytest.skip("GGUF weights are kept only with the compiled kernels")
    path = _tiny_gemma_like_gguf(tmp_path / "tiny.gguf")
    fused = LLM(str(path), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=128, block_size=4)
    model = fused.engine.loaded.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, PartsLinear)
    assert isinstance(model.layers[0].self_attn.o_proj, KQuantLinear) and fused.engine.runner.fused is not None
    served = check_every_fused_step(fused)
    plain = LLM(str(path), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=128, block_size=4,
                fused_decode=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    got, want = fused.generate(PROMPTS[:6], params), plain.generate(PROMPTS[:6], params)
    assert served and all(same for _, same in served)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert [g.outputs[0].logprobs for g in got] == [w.outputs[0].logprobs for w in want]


def test_a_layer_on_the_torch_route_keeps_decode_on_the_python_model(tmp_path: Path) -> None:
    """A kept layer forced onto the "torch" route (the float reference; tests force routes) has no C++ kernel to
    hand the stack, so the stack refuses the model, naming the layer."""
    if not KQuantLinear.kernel_routes():
        pytest.skip("GGUF weights are kept only with the compiled kernels")
    path = _tiny_gemma_like_gguf(tmp_path / "tiny.gguf")
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=128, block_size=4)
    model = llm.engine.loaded.model
    o = model.layers[0].self_attn.o_proj
    o.route = "torch"
    why = FusedDecoder.supports(K, model, torch.device("cpu"))
    assert why is not None and "o_proj" in why
