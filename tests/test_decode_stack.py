"""The fused decode step (engine/fused_decode.py, kernels/csrc/decode_stack.cpp) against its oracle, the
Python model with the same kernels: bit-identical hidden states on every step it serves, for each kind
of layer and cache it supports, and the same tokens and logprobs from the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.cli import build_parser, engine_config
from tokenloom.engine.fused_decode import FusedDecoder
from tokenloom.kernels import load_cpu_kernels

from conftest import make_tiny_model

K = load_cpu_kernels()
pytestmark = pytest.mark.skipif(K is None or not K.skinny_available(),
                                reason="the fused decode step needs the C++ kernels with AVX512-BF16")

PROMPTS = ["the cat sat on the mat", "a", "one two three four five six seven eight nine ten eleven twelve",
           "hello world", "the the the the the", "numbers 1 2 3 4 5 6 7 8 9", "x y z", "lorem ipsum dolor sit amet",
           "a b a b a b a b", "zebra", "quick brown fox jumps over the lazy dog", "end"]

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (make_tiny_model arguments, engine options)
    "bf16": ({}, {}),
    "bf16 without prepacked weights": ({}, {"prepack_weights": False}),
    "qwen2 qkv bias": ({"arch": "qwen2"}, {}),
    "mistral sliding window 8": ({"arch": "mistral", "sliding_window": 8}, {}),
    "int8 weights": ({}, {"quantization": "int8"}),
    "int4 weights g32": ({}, {"quantization": "int4", "quant_group_size": 32}),
    "int8 kv cache, per-head scales": ({}, {"kv_cache_dtype": "int8"}),
    "int8 kv cache, per-token scales": ({}, {"kv_cache_dtype": "int8", "kv_cache_scales": "token"}),
    "self-draft speculation": ({}, {"speculative": "self", "draft_layers": 1, "num_speculative_tokens": 3}),
}


def _llm(folder: Path, fused: bool, **kw: Any) -> LLM:
    return LLM(str(folder), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256, block_size=4,
               fused_decode=fused, **kw)


def _check_every_step(runner: Any) -> list[tuple[int, bool]]:
    """Run every step the stack serves through the Python model too; the list gets (rows, hidden states equal
    bit for bit) per step (writing the same K/V to the same slots twice changes nothing)."""
    inner = runner.fused.forward
    served: list[tuple[int, bool]] = []

    def checked(input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        got = inner(input_ids, positions, meta)
        want = runner.model(input_ids, positions, runner.kv_caches, meta)
        served.append((input_ids.numel(), torch.equal(got, want)))
        return got

    runner.fused.forward = checked
    return served


@pytest.mark.parametrize("case", list(CASES))
def test_fused_decode_equals_the_python_model(tmp_path: Path, case: str) -> None:
    model_kw, engine_kw = CASES[case]
    folder = make_tiny_model(tmp_path / "m", seed=3, **model_kw)
    fused, plain = _llm(folder, True, **engine_kw), _llm(folder, False, **engine_kw)
    runner = fused.engine.runner
    assert runner.fused is not None and plain.engine.runner.fused is None
    served = _check_every_step(runner)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    got, want = fused.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert served and all(same for _, same in served)
    assert max(n for n, _ in served) > 8  # the many-row matmuls (oneDNN) as well as the few-row kernels
    if engine_kw.get("speculative"):
        assert fused.engine.spec_stats.draft_tokens > 0  # verification rows went through the stack
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_single_stream_decode_uses_the_stack(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama, True)
    calls = []
    inner = llm.engine.runner.fused.forward

    def counted(*a: Any) -> torch.Tensor:
        calls.append(a[0].numel())
        return inner(*a)

    llm.engine.runner.fused.forward = counted  # type: ignore[method-assign]
    prompt = list(range(5, 25))  # 20 tokens: a prefill chunk, which the Python model computes
    out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    # Each later token is one decode row through the stack.
    assert len(out[0].outputs[0].token_ids) == 10 and calls == [1] * 9
    # A prompt of at most 8 tokens attends as decode rows (attention/sdpa.py), so the stack computes it.
    calls.clear()
    llm.generate([list(range(40, 45))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert calls == [5, 1, 1]


def test_models_the_stack_does_not_serve_fall_back(tiny_llama: Path) -> None:
    f32 = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    assert f32.engine.runner.fused is None
    assert "bfloat16 only" in (FusedDecoder.supports(K, f32.engine.loaded.model, torch.device("cpu")) or "")
    assert FusedDecoder.supports(None, f32.engine.loaded.model, torch.device("cpu")) == "no CPU kernels"
    ref = _llm(tiny_llama, True, attention_backend="reference")
    assert ref.engine.runner.fused is None
    assert engine_config(build_parser().parse_args(["generate", "hi", "--no-fused-decode"])).fused_decode is False
    assert engine_config(build_parser().parse_args(["generate", "hi"])).fused_decode is True


def test_stack_rejects_bad_layers() -> None:
    with pytest.raises(RuntimeError, match="bits must be 16, 8 or 4"):
        K.FusedLinear(torch.zeros(4, 4, dtype=torch.bfloat16), None, None, None, 3)
    with pytest.raises(RuntimeError, match="needs its scales"):
        K.FusedLinear(torch.zeros(4, 32, dtype=torch.int8), None, None, None, 8)
    with pytest.raises(RuntimeError, match="bfloat16 weight"):
        K.FusedLinear(torch.zeros(4, 4), None, None, None, 16)


@pytest.mark.parametrize("arch,window", [("llama", 0), ("qwen2", 0), ("mistral", 48)])
def test_threaded_step_equals_the_python_model(tmp_path: Path, arch: str, window: int) -> None:
    """A bfloat16 model's few-row decode steps on the stack's own threads (forward_threaded: head size 64, which
    has the bfloat16 attention kernel; qwen2 adds q/k/v biases, mistral a window shorter than the contexts),
    equal to the Python model bit for bit, with contexts long enough that the attention's pieces cut items
    between the two threads (3 KV heads of ~150-250 tokens) and are combined."""
    extra: dict[str, Any] = {"sliding_window": window} if window else {}
    folder = make_tiny_model(tmp_path / "m", arch=arch, seed=5, hidden_size=192, num_attention_heads=3,
                             num_key_value_heads=3, intermediate_size=256, **extra)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # Without prepacked copies every dense layer takes skinny_linear up to 8 rows (with them, up to the
        # count measured at start-up), so 1-8 rows run threaded whatever the CPU measured.
        llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=512, block_size=16,
                  enable_prefix_caching=False, prepack_weights=False)
        runner = llm.engine.runner
        stack = runner.fused.stack
        assert [stack.threaded(b) for b in (1, 8, 9)] == [True, True, False]
        served = _check_every_step(runner)
        prompts = [[3 + i % 300 for i in range(n)] for n in (150, 90, 230)]
        params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, temperature=0.0)
        got = llm.generate(prompts, params) + llm.generate(prompts[2:], params)  # three rows, then one
        assert served and all(same for _, same in served)
        assert {n for n, _ in served} >= {1, 3}
        # The per-kernel path (threads off) gives the same tokens and logprobs.
        stack.set_threaded(False)
        again = llm.generate(prompts, params) + llm.generate(prompts[2:], params)
        for g, w in zip(got, again):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].logprobs == w.outputs[0].logprobs
    finally:
        torch.set_num_threads(before)
