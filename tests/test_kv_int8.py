"""INT8 KV cache (--kv-cache-dtype int8, per-head or per-token scales): quantization error, capacity,
calibration, and outputs through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import PROMPTS
from tokenloom import LLM, SamplingParams
from tokenloom.attention.paged_kv import LayerKVCache, dequantize_kv, quantize_kv
from tokenloom.config import KVCacheFormat
from tokenloom.engine.kv_cache import KVCacheSpec, plan_capacity
from tokenloom.engine.kv_calibration import CALIBRATION_CHAT, HEADROOM, SEGMENT, calibration_prompts
from tokenloom.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_round_trip_error_is_within_half_a_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # rows of very different ranges
    x[7, 1] = 0.0  # an all-zero head must not divide by zero
    codes, scale = quantize_kv(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (50, 3)
    err = (dequantize_kv(codes, scale, torch.float32) - x).abs()
    assert torch.all(err <= scale.float()[..., None] / 2 * (1 + 1e-6))
    assert torch.equal(dequantize_kv(codes, scale, torch.float32)[7, 1], torch.zeros(64))
    assert codes.abs().max() <= 127


def test_fixed_scales_round_trip_within_half_a_step_and_saturate_beyond() -> None:
    torch.manual_seed(2)
    fixed = torch.tensor([0.01, 0.1, 1.0], dtype=torch.float16)
    x = torch.randn(40, 3, 64)
    codes, scale = quantize_kv(x, fixed)
    assert scale.shape == (40, 3) and torch.equal(scale[5], fixed)
    err = (dequantize_kv(codes, scale, torch.float32) - x).abs()
    inside = x.abs() <= 127 * fixed.float()[:, None]
    assert torch.all(err[inside] <= (scale.float()[..., None] / 2 * (1 + 1e-6)).expand_as(x)[inside])
    assert not inside[:, 0].all() and torch.all(codes[:, 0][~inside[:, 0]].abs() == 127)  # saturated, not wrapped


@pytest.mark.parametrize("per_head", [False, True])
def test_write_returns_what_the_cache_holds(per_head: bool) -> None:
    torch.manual_seed(1)
    fixed = (torch.tensor([0.02, 0.03]), torch.tensor([0.025, 0.02])) if per_head else None
    fmt = KVCacheFormat.INT8_PER_HEAD if per_head else KVCacheFormat.INT8_PER_TOKEN
    kv = LayerKVCache.allocate(8, 4, 2, 16, torch.float32, fmt, torch.device("cpu"), fixed)
    assert kv.per_head_scales == per_head
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3, 9, 10, 17, 30])
    k_seen, v_seen = kv.write(k, v, slots)
    got_k, got_v = kv.gather_blocks(torch.arange(8), torch.float32)
    assert torch.equal(got_k.flatten(0, 1)[slots], k_seen)
    assert torch.equal(got_v.flatten(0, 1)[slots], v_seen)
    assert not torch.equal(k_seen, k)  # quantized, and close
    torch.testing.assert_close(k_seen, k, atol=0.03, rtol=0)


def _smollm2_spec(quantized: bool, per_head: bool = True) -> KVCacheSpec:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims, bfloat16.
    return KVCacheSpec(30, 3, 64, 16, torch.bfloat16, KVCacheFormat.of("int8" if quantized else "auto",
                                                                       "head" if per_head else "token"))


def test_int8_doubles_the_blocks_and_sequences_for_a_fixed_budget() -> None:
    cpu = torch.device("cpu")
    bf16 = plan_capacity(_smollm2_spec(False), "1GiB", cpu, 2048)
    head = plan_capacity(_smollm2_spec(True), "1GiB", cpu, 2048)
    token = plan_capacity(_smollm2_spec(True, per_head=False), "1GiB", cpu, 2048)
    # bfloat16: 2 x 64 bytes per token and head; int8 per head: 64 codes; per token: 64 codes + a 2-byte scale.
    assert _smollm2_spec(False).bytes_per_token == 2 * 30 * 3 * 128
    assert _smollm2_spec(True).bytes_per_token == 2 * 30 * 3 * 64
    assert _smollm2_spec(True, per_head=False).bytes_per_token == 2 * 30 * 3 * 66
    # Whole blocks of a budget: half the bytes per block buys twice the blocks (+1 where the remainder fits one).
    assert head.num_blocks // 2 == bf16.num_blocks and int(head.max_concurrency) >= 2 * int(bf16.max_concurrency)
    assert token.num_blocks == 2**30 // (16 * 2 * 30 * 3 * 66)
    assert token.max_concurrency / bf16.max_concurrency == pytest.approx(128 / 66, rel=1e-3)
    assert "KV cache (bfloat16)" in bf16.describe()
    assert "KV cache (int8, per-head scales)" in head.describe()
    assert "KV cache (int8, per-token scales)" in token.describe()


def test_engine_reports_int8_capacity(tiny_llama: Path) -> None:
    base = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
    q = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8")
    t = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8", kv_cache_scales="token")
    # The tiny model has 16-dim heads: 64 bytes per head-token in float32 against 16 (per head) or 16 + 2.
    assert q.engine.capacity.num_blocks == base.engine.capacity.num_blocks * 4
    assert t.engine.capacity.num_blocks == pytest.approx(base.engine.capacity.num_blocks * 64 / 18, rel=1e-3)
    assert q.engine.runner.kv_caches[0].k.dtype == torch.int8 and q.engine.runner.kv_caches[0].per_head_scales
    assert not t.engine.runner.kv_caches[0].per_head_scales


def test_calibrated_scales_cover_the_largest_value_of_each_head(tiny_llama: Path) -> None:
    """The per-head scales are HEADROOM x the largest |K| and |V| the calibration text writes, checked
    against the per-token cache's own scales (max|x| / 127 of each token) after prefilling that text:
    to float16 rounding in layer 0, and within the INT8 noise that the per-token cache's attention adds
    to later layers' inputs (calibration runs on a float cache)."""
    q = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8")
    t = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8", kv_cache_scales="token",
            enable_prefix_caching=False)
    prompts = calibration_prompts(t.tokenizer, t.engine.loaded.model.rotary.max_position)  # as the engine's
    system = t.tokenizer.encode_chat(CALIBRATION_CHAT[:1], add_generation_prompt=False)
    assert len(prompts) > 3 and prompts[0][: len(system)] == system  # a chat in the model's template first
    assert {len(p) for p in prompts[:-1]} == {SEGMENT}
    t.generate(prompts, SamplingParams(temperature=0, max_tokens=1))  # writes the K/V of every prompt token
    for layer, (fixed, per_token) in enumerate(zip(q.engine.runner.kv_caches, t.engine.runner.kv_caches)):
        for s_fixed, s_token in ((fixed.k_scale, per_token.k_scale), (fixed.v_scale, per_token.v_scale)):
            largest = s_token.float().amax(dim=(0, 1))  # (Hkv,): zeros of unwritten slots never win
            rtol = 2 * 2**-11 + 1e-4 if layer == 0 else 0.03  # two float16 roundings | + INT8 noise
            torch.testing.assert_close(s_fixed[0, 0].float(), largest * HEADROOM, rtol=rtol, atol=0)


def test_bad_kv_cache_options_are_rejected(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        LLM(str(tiny_llama), kv_cache_dtype="fp4")
    with pytest.raises(ConfigError, match="kv-cache-scales"):
        LLM(str(tiny_llama), kv_cache_dtype="int8", kv_cache_scales="block")


SCALES = ["head", "token"]


@pytest.fixture(scope="module", params=SCALES)
def int8_baseline(request: pytest.FixtureRequest, tiny_llama: Path) -> tuple[str, list[list[int]]]:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8",
              kv_cache_scales=request.param, attention_backend="reference")
    return request.param, [o.outputs[0].token_ids for p in PROMPTS for o in llm.generate([p], GREEDY)]


@pytest.mark.parametrize(
    "engine",
    [
        {},  # the C++ kernel, whole batch
        {"attention_backend": "sdpa"},
        {"block_size": 5, "max_num_batched_tokens": 7, "max_num_seqs": 2},  # tiny prefill chunks
        {"block_size": 4, "max_model_len": 256, "kv_cache_memory": str(80 * 4 * 2 * 2 * 2 * 18),
         "enable_prefix_caching": False},  # 80 blocks per token scales, 90 per head: preemption
        {"speculative": "ngram", "num_speculative_tokens": 3},  # verification chunks read the INT8 cache
    ],
)
def test_int8_greedy_is_batch_and_backend_invariant(tiny_llama: Path, int8_baseline: tuple[str, list[list[int]]],
                                                     engine: dict[str, object]) -> None:
    """The cache, not the chunking, decides what attention sees: any batch, chunk size, backend or
    preemption gives the same tokens as the reference backend, one prompt at a time."""
    scales, baseline = int8_baseline
    kw: dict[str, object] = {"dtype": "float32", "kv_cache_memory": "16MiB", "kv_cache_dtype": "int8",
                             "kv_cache_scales": scales, **engine}
    llm = LLM(str(tiny_llama), **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, GREEDY)]
    assert got == baseline * 2
    llm.engine.kv.pool.check_invariants()


@pytest.mark.parametrize("scales", SCALES)
def test_int8_logprobs_stay_close_to_the_float_cache(tiny_llama: Path, scales: str) -> None:
    """Quantization noise in K/V moves the next-token log-probabilities by little."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    base = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB").generate(PROMPTS, sp)
    q = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8",
            kv_cache_scales=scales).generate(PROMPTS, sp)
    for a, b in zip(base, q):
        # The first token's distribution comes from the prompt's attention over quantized K/V.
        first_a, first_b = a.outputs[0].logprobs[0].top, b.outputs[0].logprobs[0].top
        shared = first_a.keys() & first_b.keys()
        assert len(shared) >= 4
        for tok in shared:
            assert abs(first_b[tok] - first_a[tok]) < 0.05
