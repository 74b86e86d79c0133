"""Sliding-window KV memory: windowed layers release the blocks behind their reach, the full-attention
layers keep theirs, and outputs stay those of transformers (chunked prefill, preemption, prefix-cache
hits, speculative decoding). Tiny models: Mistral (every layer windowed, one KV group) and Qwen2 with
`layer_types` (one full layer, two windowed: three groups of one layer sharing the pool)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from conftest import hf_greedy_ids, make_tiny_model
from tokenloom import LLM, SamplingParams
from tokenloom.disagg.blocks import KVLayout
from tokenloom.engine.kv_cache import KVCacheSpec, KVGroup, kv_groups, plan_capacity
from tokenloom.engine.kv_cache_manager import KVCacheManager
from tokenloom.engine.sequence import Sequence
from tokenloom.errors import ConfigError
from tokenloom.models.config import ModelConfig

WINDOW = 16
BLOCK = 4
MAX_NEW = 16
# Chunked prefill (24-token steps), 4-token blocks, float32 end to end.
KW = dict(dtype="float32", block_size=BLOCK, max_model_len=160, max_num_batched_tokens=24, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mistral"), arch="mistral", seed=11, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # transformers writes layer_types = [full, sliding, sliding] (layers from max_window_layers on slide)
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=12, num_hidden_layers=3,
                           use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _ids(outs: list) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_layer_types_give_the_groups(hybrid: Path, mistral: Path) -> None:
    cfg = ModelConfig.from_hf_folder(hybrid)
    assert [cfg.layer_window(i) for i in range(3)] == [None, WINDOW, WINDOW]
    assert kv_groups(cfg, 160) == (KVGroup(None, (0,)), KVGroup(WINDOW, (1,)), KVGroup(WINDOW, (2,)))
    assert kv_groups(cfg, 160, release_windowed=False) == (KVGroup(None, (0, 1, 2)),)
    assert kv_groups(cfg, WINDOW) == (KVGroup(None, (0, 1, 2)),)  # the window never binds: nothing to release
    m = ModelConfig.from_hf_folder(mistral)
    assert kv_groups(m, 160) == (KVGroup(WINDOW, (0, 1)),)


@pytest.mark.parametrize("name", ["mistral", "hybrid"])
def test_windowed_groups_hold_what_the_window_needs(name: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(name)
    llm = LLM(str(folder), kv_cache_memory="1MiB", **KW)
    eng, kv = llm.engine, llm.engine.kv
    windows = kv.windows
    assert any(w == WINDOW for w in windows)
    prompt = _prompts(eng.model_config.vocab_size, [118])[0]  # over 7 windows
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), request_id="r")
    seq = eng.requests["r"].seqs[0]
    steps_after_prefill = 0
    while eng.has_unfinished_requests():
        eng.step()
        kv.pool.check_invariants()
        if seq.status.finished:
            break
        nc = seq.num_computed_tokens
        # Keys the next step's first query (position nc) reaches: [nc - W + 1, nc); a full group all of [0, nc).
        first = max(0, nc - WINDOW + 1) // BLOCK
        last = -(-nc // BLOCK)
        want = [last if w is None else last - first for w in windows]
        assert kv.held_blocks(seq) == want, f"after {nc} computed tokens"
        # The pool agrees: one request, and every block it does not reference is free or cached.
        assert kv.pool.num_used == sum(want)
        if nc >= len(prompt):
            steps_after_prefill += 1
            windowed = [h for h, w in zip(kv.held_blocks(seq), windows) if w is not None]
            assert max(windowed) <= -(-(WINDOW - 1) // BLOCK) + 1  # decoding stays bounded
    assert steps_after_prefill >= 30
    assert kv.held_blocks(seq) == [0] * len(windows) and kv.pool.num_used == 0
    assert llm.stats()["kv_blocks_released_by_window"] > 0


@pytest.mark.parametrize(("name", "backend"), [("mistral", "auto"), ("hybrid", "auto"), ("hybrid", "sdpa"),
                                               ("hybrid", "reference")])
def test_greedy_matches_transformers_with_chunks_and_preemption(name: str, backend: str,
                                                                request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(name)
    # Few enough blocks that the five sequences cannot all grow at once: some are preempted and recomputed.
    budget = {"mistral": 20 * 2048, "hybrid": 70 * 1024}[name]  # blocks x bytes per block
    llm = LLM(str(folder), kv_cache_memory=str(budget), attention_backend=backend, **KW)
    prompts = _prompts(llm.engine.model_config.vocab_size, [37, 70, 18, 53, 9], seed=1)
    got = _ids(llm.generate(prompts, GREEDY))
    assert llm.stats()["preemptions"] > 0
    llm.engine.kv.pool.check_invariants()
    assert llm.engine.kv.pool.num_used == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        want = [hf_greedy_ids(hf, p, MAX_NEW)[0] for p in prompts]
    assert got == want


def test_prefix_cache_hits_give_the_same_ids(hybrid: Path) -> None:
    cached = LLM(str(hybrid), kv_cache_memory="1MiB", **KW)
    plain = LLM(str(hybrid), kv_cache_memory="1MiB", enable_prefix_caching=False, **KW)
    vocab = cached.engine.model_config.vocab_size
    head = _prompts(vocab, [61], seed=2)[0]  # shared by all: several windows, released in the windowed groups
    prompts = [head + tail for tail in _prompts(vocab, [5, 13, 1, 30], seed=3)]
    first = _ids(cached.generate(prompts[:1], GREEDY))
    outs = cached.generate(prompts[1:], GREEDY)
    assert all(o.num_cached_tokens >= 60 for o in outs)  # the shared head came from the cache
    assert first + _ids(outs) == _ids(plain.generate(prompts, GREEDY))
    cached.engine.kv.pool.check_invariants()


def test_prefix_hit_needs_every_group() -> None:
    """A windowed group's released blocks are evicted first; a later hit must stop where one is missing,
    even though the full group still holds the whole prefix."""
    kv = KVCacheManager(20, BLOCK, windows=[None, 8])
    params = SamplingParams(temperature=0.0, max_tokens=4)
    tokens = list(range(10, 51))  # 41 tokens: 10 full blocks before the last token

    def seq(i: int) -> Sequence:
        return Sequence(f"s{i}", f"s{i}", 0, tokens, params, 4, frozenset(), i)

    a = seq(0)
    assert kv.allocate_slots(a, 40, kv.find_cached_prefix(a))
    a.num_computed_tokens = 40
    kv.cache_full_blocks(a)
    kv.release(a)
    assert kv.held_blocks(a) == [10, 2]  # blocks of positions 32..39 cover keys 33..39 of query 40
    kv.free(a)
    kv.pool.check_invariants()
    assert kv.pool.num_cached == 20 and kv.pool.num_used == 0
    b = seq(1)
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 10
    # It takes the full group's 10 and only the windowed group's last 2, plus a new block each; those two
    # evict the least recently used cached blocks: the windowed group's first (released first).
    assert kv.allocate_slots(b, 1, hit)
    assert b.num_computed_tokens == 40 and kv.held_blocks(b) == [11, 3] and b.num_released == [0, 8]
    kv.free(b)
    kv.pool.check_invariants()
    parent = -1
    for i, h in enumerate(b.block_hashes[:10]):  # the full group still holds the whole prefix
        found = kv.pool.lookup(h, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), parent, 0)
        assert found is not None
        parent = found
    c = seq(2)
    assert kv.find_cached_prefix(c).num_blocks == 0  # the windowed group's chain breaks at block 0


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_speculative_decoding_gives_the_same_ids(hybrid: Path, method: str) -> None:
    base = LLM(str(hybrid), kv_cache_memory="1MiB", **KW)
    vocab = base.engine.model_config.vocab_size
    # Repeating prompts give the n-gram proposer matches; long enough for windows to release blocks.
    prompts = [(p * 8)[:n] for p, n in zip(_prompts(vocab, [5, 7, 3], seed=4), [60, 45, 33])]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    extra = {"draft_layers": 1} if method == "self" else {}
    spec = LLM(str(hybrid), kv_cache_memory="1MiB", speculative=method, num_speculative_tokens=3, **extra, **KW)
    assert _ids(spec.generate(prompts, sp)) == _ids(base.generate(prompts, sp))
    s = spec.stats()
    assert s["spec_decode_draft_tokens"] > 0 and s["kv_blocks_released_by_window"] > 0
    spec.engine.kv.pool.check_invariants()
    assert spec.engine.kv.pool.num_used == 0


def test_capacity_report_counts_released_blocks(hybrid: Path) -> None:
    # Gemma-3-270M-shaped: 18 layers, every 6th global, window 512; 1 KV head of 256; bfloat16; 16-token blocks.
    gemma = ModelConfig("Qwen2ForCausalLM", 1000, 640, 2048, 18, 4, 1, 256, 32768, sliding_window=512,
                        layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)))
    groups = kv_groups(gemma, 32768)
    assert [(g.window, len(g.layers)) for g in groups] == [(None, 3)] + [(512, 3)] * 5
    spec = KVCacheSpec.for_model(gemma, 16, torch.bfloat16)
    per_block = 2 * 3 * 1 * 256 * 2 * 16  # K and V, 3 layers of a group, 1 head of 256 bf16 values, 16 tokens
    cap = plan_capacity(spec, str(3000 * per_block + 5), torch.device("cpu"), 32768, groups=groups, chunk=512)
    assert cap.num_blocks == 3000 and cap.bytes_total == 3000 * per_block
    # A 32k-token sequence: the full group keeps 2048 blocks; each windowed group at most the blocks over the
    # 511 keys behind a step's first query and a 512-token chunk, misaligned: ceil(1023 / 16) + 1 = 65.
    assert cap.blocks_per_seq(32768) == 2048 + 5 * 65
    assert cap.blocks_per_seq(100) == 6 * 7  # below the window every group holds every block
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        plan_capacity(spec, str(2000 * per_block), torch.device("cpu"), 32768, groups=groups, chunk=512)
    cap = plan_capacity(spec, str(4746 * per_block), torch.device("cpu"), 32768, groups=groups, chunk=512)
    assert cap.max_concurrency == pytest.approx(2.0)
    text = cap.describe()
    assert "6 KV groups" in text and "3 full-attention layers (1 groups)" in text
    assert "15 layers of window 512 (5 groups) keep at most 65 blocks" in text
    assert "holds 2373 blocks (12288 without" in text and "2.00 sequences" in text
    # The engine reports its own groups.
    llm = LLM(str(hybrid), kv_cache_memory=str(100 * 1024), **KW)
    assert llm.engine.capacity.groups == kv_groups(llm.engine.model_config, 160)
    assert llm.engine.capacity.num_blocks == 100  # 1 layer x 2 (K, V) x 2 heads x 16 dims x 4 bytes x 4 tokens
    assert "3 KV groups" in llm.engine.capacity.describe()


def test_kv_transfer_refuses_several_groups(hybrid: Path, mistral: Path) -> None:
    with pytest.raises(ConfigError, match="sliding-window and full-attention layers"):
        KVLayout.of(LLM(str(hybrid), kv_cache_memory="1MiB", **KW).engine)
    # One windowed group is the plain layout: its blocks travel as before.
    assert KVLayout.of(LLM(str(mistral), kv_cache_memory="1MiB", **KW).engine).num_layers == 2


def test_fused_decode_stack_reads_only_the_window(mistral: Path) -> None:
    """The C++ decode stack serves Mistral's one windowed group: released table entries lie outside the
    window it reads, so its tokens are the Python path's."""
    kw = dict(KW, dtype="bfloat16", kv_cache_memory="1MiB")
    fused = LLM(str(mistral), **kw)
    if fused.engine.runner.fused is None:
        pytest.skip("no fused decode stack here (needs the CPU kernels and AVX512-BF16)")
    prompts = _prompts(fused.engine.model_config.vocab_size, [40, 71, 23], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = _ids(fused.generate(prompts, sp))
    assert fused.stats()["kv_blocks_released_by_window"] > 0
    assert got == _ids(LLM(str(mistral), fused_decode=False, **kw).generate(prompts, sp))


def test_siblings_and_abort_on_a_windowed_model(hybrid: Path) -> None:
    """n > 1: the siblings find the leader's prompt in the prefix cache (every group's blocks) and sample
    what they sample without it; an abort mid-way returns every block."""
    kw = dict(KW, kv_cache_memory="1MiB")
    on, off = LLM(str(hybrid), **kw), LLM(str(hybrid), enable_prefix_caching=False, **kw)
    prompts = _prompts(on.engine.model_config.vocab_size, [45, 66], seed=6)
    sp = SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    assert _ids(on.generate(prompts, sp)) == _ids(off.generate(prompts, sp))
    assert on.stats()["prefix_cache_hits"] > 0
    eng = on.engine
    eng.add_request(prompts[1], sp, request_id="gone")
    for _ in range(6):  # through the prefill chunks and into decoding
        eng.step()
    assert eng.kv.pool.num_used > 0 and eng.stats.counters(eng.scheduler, eng.kv)["kv_blocks_released_by_window"] > 0
    eng.abort_request("gone")
    eng.kv.pool.check_invariants()
    assert eng.kv.pool.num_used == 0 and not eng.has_unfinished_requests()
