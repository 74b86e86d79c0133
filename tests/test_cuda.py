"""The parity tests on a CUDA device (issue 21, item 6): every architecture family's tiny model runs through the
paged cache on the GPU and is checked against transformers on the CPU.

float32: greedy ids identical over 16 tokens for a batch of mixed-length prompts, and the first token's top
logprobs within LOGPROB_ATOL, with prefill in chunks of at most 16 tokens and a cache too small for the batch
(requests are preempted and recomputed). bfloat16 on the GPU: the same greedy ids as float32 on these peaked
logits for most tokens. Prefix-cache hits and n-gram speculation leave greedy ids unchanged.

Skipped where torch sees no CUDA device. `pytest tests/test_cuda.py --device-under-test cpu` runs the very
same checks on the CPU: that is how the GPU script (benchmarks/gpu_check.sh) is dry-run before a device lease.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, assert_matches_reference, make_tiny_model
from test_gemma3 import make_tiny_gemma
from test_models import MAX_NEW, hf_greedy
from test_moe import make_tiny_moe
from test_phi3 import CONFIGS as PHI3_CONFIGS, PHI3
from test_qwen3 import make_tiny_qwen3
from tokenloom import LLM, SamplingParams
from tokenloom.models.config import ModelConfig

# float32 on both sides; the GPU's reductions run in another order than the CPU's (no TF32: torch leaves
# float32 matmuls in full precision unless told otherwise), so a little more room than the CPU tests' 2e-4.
LOGPROB_ATOL = 5e-4

Maker = Callable[[Path], Path]
# The cache budget of the preemption test, in blocks of 4 tokens' K/V for every layer: too few for the batch of
# PROMPTS. Models with windowed layers release the blocks behind their windows, so they get less: Mistral's
# layers are all windowed; Gemma 3's one global layer still needs a whole sequence (160 tokens).
CACHE_BLOCKS = {"mistral-window": 12, "gemma3": 16}
FAMILIES: dict[str, tuple[Maker, dict[str, object]]] = {
    # name: (folder maker, transformers' from_pretrained kwargs)
    "llama": (lambda p: make_tiny_model(p, seed=0), {}),
    "qwen2-tied": (lambda p: make_tiny_model(p, arch="qwen2", seed=3, tie_word_embeddings=True), {}),
    "mistral-window": (lambda p: make_tiny_model(p, arch="mistral", seed=5, sliding_window=6),
                       {"attn_implementation": "eager"}),
    "qwen3": (lambda p: make_tiny_qwen3(p, seed=11, tie_word_embeddings=True), {}),
    "phi3-longrope": (lambda p: make_tiny_model(p, arch="phi3", seed=22,
                                                **(PHI3 | {k: v for k, v in PHI3_CONFIGS["longrope"].items() if k != "seed"})), {}),
    "gemma3": (lambda p: make_tiny_gemma(p, seed=21), {}),
    "mixtral": (lambda p: make_tiny_moe(p, "mixtral", seed=31), {}),
    "qwen3moe": (lambda p: make_tiny_moe(p, "qwen3moe", seed=32), {}),
}


@pytest.fixture(scope="module")
def device(request: pytest.FixtureRequest) -> str:
    name = str(request.config.getoption("--device-under-test"))
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device (run on a GPU machine, or --device-under-test cpu)")
    return name


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict[str, object]]:
    name = str(request.param)
    maker, hf_kwargs = FAMILIES[name]
    return name, maker(tmp_path_factory.mktemp(name)), hf_kwargs


def _cache_bytes(folder: Path, blocks: int, block_size: int) -> int:
    cfg = ModelConfig.from_hf_folder(folder)
    return blocks * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * block_size  # float32 K,V


def _assert_on(llm: LLM, device: str) -> None:
    """The engine, its weights and its KV cache all live on the device under test."""
    want = torch.device(device).type
    assert llm.engine.device.type == want
    assert {p.device.type for p in llm.engine.loaded.model.parameters()} == {want}
    assert {c.k.device.type for c in llm.engine.runner.kv_caches} == {want}


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_greedy_matches_transformers_with_chunks_and_preemption(
    device: str, family: tuple[str, Path, dict[str, object]], backend: str
) -> None:
    name, folder, hf_kwargs = family
    blocks = CACHE_BLOCKS.get(name, 48)
    llm = LLM(str(folder), dtype="float32", device=device, block_size=4, max_model_len=160,
              kv_cache_memory=str(_cache_bytes(folder, blocks, 4)), max_num_batched_tokens=16, max_num_seqs=8,
              enable_prefix_caching=False, attention_backend=backend)
    _assert_on(llm, device)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))
    assert llm.engine.scheduler.num_preemptions > 0
    ref_ids, ref_lp = hf_greedy(folder, prompts, **hf_kwargs)
    assert_matches_reference(outs, ref_ids, ref_lp, LOGPROB_ATOL)
    llm.engine.kv.pool.check_invariants()


def test_bfloat16_mostly_agrees_with_float32(device: str, family: tuple[str, Path, dict[str, object]]) -> None:
    """bfloat16 rounds every activation: its greedy ids may part from float32's after a near tie, so the bar is
    agreement on the first token of every prompt and on most tokens overall (the CPU bfloat16 tests' bar)."""
    _, folder, _ = family
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(folder), dtype=dtype, device=device, kv_cache_memory="16MiB")
        _assert_on(llm, device)
        runs[dtype] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        del llm
    f32, b16 = runs["float32"], runs["bfloat16"]
    assert all(a[0] == b[0] for a, b in zip(f32, b16))
    same = sum(x == y for a, b in zip(f32, b16) for x, y in zip(a, b))
    assert same >= 0.75 * sum(len(a) for a in f32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cuda-llama"), seed=7)


def test_prefix_cache_hits_keep_greedy_ids(device: str, llama: Path) -> None:
    """A second request sharing a 3-block prefix reuses its blocks on the device and decodes the same ids."""
    llm = LLM(str(llama), dtype="float32", device=device, block_size=16, kv_cache_memory="16MiB")
    prompt = llm.tokenizer.encode(PROMPTS[3])
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([prompt], sp)[0]
    again = llm.generate([prompt], sp)[0]
    assert again.num_cached_tokens >= 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.kv.pool.check_invariants()


def test_ngram_speculation_keeps_greedy_ids(device: str, llama: Path) -> None:
    """Draft tokens verified by the target in one pass on the device: greedy output equals plain decoding."""
    prompts = [PROMPTS[0] * 3, PROMPTS[3]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(llama), dtype="float32", device=device, kv_cache_memory="16MiB")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    del plain
    spec = LLM(str(llama), dtype="float32", device=device, kv_cache_memory="16MiB", speculative="ngram",
               num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == want


def test_seeded_sampling_is_reproducible(device: str, llama: Path) -> None:
    llm = LLM(str(llama), dtype="float32", device=device, kv_cache_memory="16MiB")
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sp)]
    b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sp)]
    assert a == b
