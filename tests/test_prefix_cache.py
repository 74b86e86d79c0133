"""Automatic prefix caching: the block pool's cache index, the manager's sharing, and engine outputs that
are the same with and without it."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from conftest import LiveServer
from tokenloom import LLM, SamplingParams
from tokenloom.cli import build_parser, engine_config
from tokenloom.engine.block_pool import NO_PARENT, BlockPool

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


# -- the pool ---------------------------------------------------------------------------------------


def test_lookup_confirms_tokens_and_parent() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, 7, (1, 2), NO_PARENT) == a
    assert pool.lookup(7, (1, 2), NO_PARENT) == a
    assert pool.lookup(7, (1, 3), NO_PARENT) is None  # same hash, other tokens: a collision is a miss
    assert pool.lookup(7, (1, 2), b) is None  # same tokens after another parent
    # A colliding block of other content is left unindexed, and the first entry stays.
    assert pool.cache(b, 7, (9, 9), NO_PARENT) == b
    assert pool.lookup(7, (1, 2), NO_PARENT) == a
    pool.check_invariants()


def test_cached_blocks_are_evicted_lru_and_only_when_needed() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, 1, (1,), NO_PARENT)
    pool.cache(b, 2, (2,), NO_PARENT)
    pool.free([c])
    pool.free([a])
    pool.free([b])  # c free; a, b cached (a least recently used)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (3, 2, 0)
    pool.check_invariants()
    assert pool.allocate(1) == [c]  # free blocks go before any cached one
    assert pool.lookup(1, (1,), NO_PARENT) == a
    assert pool.allocate(1) == [a]  # then the least recently used cached block
    assert pool.lookup(1, (1,), NO_PARENT) is None and pool.lookup(2, (2,), NO_PARENT) == b
    assert pool.num_evictions == 1
    pool.incref([b])  # a hit revives a cached block
    assert (pool.num_cached, pool.num_used) == (0, 3)
    pool.check_invariants()
    with pytest.raises(ValueError, match="is free"):
        fresh = BlockPool(2)
        fresh.incref([0])


def test_tail_blocks_are_evicted_before_their_prefix() -> None:
    pool = BlockPool(2)
    parent, child = pool.allocate(2)
    pool.cache(parent, 1, (1,), NO_PARENT)
    pool.cache(child, 2, (2,), parent)
    pool.free([child, parent])  # as the manager frees a sequence: tail first
    assert pool.lookup(2, (2,), parent) == child
    assert pool.allocate(1) == [child]
    assert pool.lookup(2, (2,), parent) is None and pool.lookup(1, (1,), NO_PARENT) == parent


def test_child_of_a_replaced_parent_is_a_miss() -> None:
    # The parent is evicted and its block reused for other content while the child stays indexed:
    # the child must not match under the new content, even with the same parent block id.
    pool2 = BlockPool(3)
    p, ch = pool2.allocate(2)
    pool2.cache(p, 1, (1,), NO_PARENT)
    pool2.cache(ch, 2, (2,), p)
    pool2.free([p])  # the parent alone becomes cached, the child stays in use
    (p_again,) = pool2.allocate(2)[1:]  # the free block first, then the evicted parent
    assert p_again == p
    pool2.cache(p, 3, (3,), NO_PARENT)
    assert pool2.lookup(2, (2,), p) is None  # generation changed: the child's chain is gone
    pool2.check_invariants()


# -- the engine -------------------------------------------------------------------------------------


def _prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    """Prompts that share prefixes in several ways: a long common system part, duplicates, a prompt
    that is a prefix of another, and unrelated ones."""
    system = [rng.randrange(3, vocab) for _ in range(37)]
    tails = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    ps = [system + t for t in tails]
    ps += [ps[0], ps[1][:-1], system[:20], [rng.randrange(3, vocab) for _ in range(25)]]
    return ps


def _ids(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_identical_with_and_without_caching(tiny_llama: Path, params: SamplingParams) -> None:
    kw = dict(dtype="float32", block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=64, max_num_seqs=8)
    off = LLM(str(tiny_llama), enable_prefix_caching=False, **kw)
    on = LLM(str(tiny_llama), **kw)
    prompts = _prompts(random.Random(0), off.engine.model_config.vocab_size)
    expected = _ids(off.generate(prompts, params))
    assert _ids(on.generate(prompts, params)) == expected  # one wave: prompts share within a step
    first = on.stats()
    assert _ids(on.generate(prompts, params)) == expected  # again: served from the cache
    second = on.stats()
    assert second["prefix_cache_hits"] > first["prefix_cache_hits"]
    assert off.stats()["prefix_cache_hits"] == 0 == off.stats()["prefix_cache_queries"]
    on.engine.kv.pool.check_invariants()
    assert on.engine.kv.pool.num_used == 0


def test_second_request_starts_at_its_first_uncached_token(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="4MiB")
    prompt = list(range(3, 3 + 22))  # 22 tokens: 5 full blocks, the last token always recomputed
    a = llm.generate([prompt], GREEDY)[0]
    assert a.num_cached_tokens == 0
    before = llm.stats()["prompt_tokens_computed"]
    b = llm.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == 20 and b.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.stats()["prompt_tokens_computed"] - before == 2  # only tokens 20 and 21
    # A prompt of exactly 5 blocks still computes its last token: 4 blocks from the cache.
    c = llm.generate([prompt[:20]], GREEDY)[0]
    assert c.num_cached_tokens == 16
    s = llm.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (22 + 22 + 20, 20 + 16)
    assert llm.reset_prefix_cache() > 0 and llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0


def test_the_n_sequences_of_a_request_compute_their_prompt_once(tiny_llama: Path) -> None:
    """n = 4 of one 22-token prompt: the first sequence computes it, the other three wait and then find its
    5 full blocks in the prefix cache (2 tokens each), instead of 4 x 22 tokens; the samples are the same as
    when each computes the prompt itself (prefix caching off)."""
    kw = dict(dtype="float32", block_size=4, kv_cache_memory="4MiB")
    prompt = list(range(3, 3 + 22))
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tiny_llama), **kw)
    got = llm.generate([prompt], params)[0]
    assert llm.stats()["prompt_tokens_computed"] == 22 + 3 * 2
    off = LLM(str(tiny_llama), enable_prefix_caching=False, **kw)
    want = off.generate([prompt], params)[0]
    assert off.stats()["prompt_tokens_computed"] == 4 * 22
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]


def test_one_request_holds_at_most_half_the_running_slots(tiny_llama: Path) -> None:
    """n = 8 with max_num_seqs 4: 2 of its sequences run at a time; a request arriving later still gets a
    slot at once, while the large request goes on (and completes all 8)."""
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="4MiB", max_num_seqs=4)
    eng = llm.engine
    big = eng.add_request(list(range(3, 11)), SamplingParams(n=8, temperature=0, max_tokens=12, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert sum(s.request_id == big for s in eng.scheduler.running) == 2
    small = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()
    assert any(s.request_id == small for s in eng.scheduler.running)
    done: dict[str, int] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = 1
    assert set(done) == {big, small} and eng.kv.pool.num_used == 0


def test_preempted_requests_are_queried_once(tiny_llama: Path) -> None:
    """A preempted request's re-admission is not a new lookup: queries count each prompt once."""
    # 2 KiB per block of 4 float32 tokens: 80 blocks = 320 tokens, far less than ten prompts + outputs.
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, max_model_len=256, kv_cache_memory=str(80 * 2048))
    prompts = [[7 + i] + list(range(40, 40 + 30 + i)) for i in range(10)]  # distinct first tokens: no sharing
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.stats()["prefix_cache_queries"] == sum(len(p) for p in prompts)


def test_forced_hash_collision_falls_back_to_recomputation(tiny_llama: Path) -> None:
    kw = dict(dtype="float32", block_size=4, kv_cache_memory="4MiB")
    off = LLM(str(tiny_llama), enable_prefix_caching=False, **kw)
    llm = LLM(str(tiny_llama), **kw)
    llm.engine.kv.hash_fn = lambda parent, tokens: 0  # every block collides with every other
    p1, p2 = list(range(3, 30)), list(range(40, 67))
    expected = _ids(off.generate([p1, p2], GREEDY))
    assert _ids(llm.generate([p1], GREEDY)) == expected[:1]
    out2 = llm.generate([p2], GREEDY)[0]  # its first block's hash finds p1's block: tokens differ
    assert out2.num_cached_tokens == 0 and out2.outputs[0].token_ids == expected[1]
    # p1 again: its first block matches for real; the second's hash points at the first block,
    # whose parent differs, so the walk stops there and recomputes the rest.
    again = llm.generate([p1], GREEDY)[0]
    assert again.num_cached_tokens == 4 and again.outputs[0].token_ids == expected[0]
    llm.engine.kv.pool.check_invariants()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_workload_with_eviction_pressure(tiny_llama: Path, seed: int) -> None:
    """Requests arrive, share prefixes, get aborted and preempted on a pool far too small for them all;
    the pool's invariant holds after every step and finished outputs match a run without caching."""
    rng = random.Random(seed)
    kw = dict(dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=6)
    ref = LLM(str(tiny_llama), enable_prefix_caching=False, kv_cache_memory="4MiB", **kw)
    # 2 KiB per block here (see test_batch_invariance): 24 blocks = 96 tokens for up to 6 sequences of
    # up to 62 tokens each.
    llm = LLM(str(tiny_llama), kv_cache_memory=str(24 * 2048), **kw)
    vocab = llm.engine.model_config.vocab_size
    heads = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    jobs: dict[str, list[int]] = {}
    eng, pool = llm.engine, llm.engine.kv.pool
    results: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for step in range(400):
        if len(jobs) < 30 and rng.random() < 0.3:
            prompt = rng.choice(heads) + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 12))]
            rid = f"r{len(jobs)}"
            jobs[rid] = prompt
            eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 20), ignore_eos=True),
                            request_id=rid)
        if eng.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(eng.requests))
            eng.abort_request(victim)
            aborted.add(victim)
        for out in eng.step():
            acc = results.setdefault(out.request_id, [])
            acc.extend(t for c in out.outputs for t in c.token_ids)
        pool.check_invariants()
        for seq in eng.scheduler.running:
            assert all(pool.ref_counts[b] > 0 for b in seq.block_ids)
        if step > 100 and not eng.requests and len(jobs) >= 30:
            break
    while eng.has_unfinished_requests():
        for out in eng.step():
            results.setdefault(out.request_id, []).extend(t for c in out.outputs for t in c.token_ids)
        pool.check_invariants()
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_evicted"] > 0 and stats["preemptions"] > 0
    assert pool.num_used == 0
    done = [rid for rid in jobs if rid not in aborted]
    for rid in done:
        sp = SamplingParams(temperature=0.0, max_tokens=len(results[rid]), ignore_eos=True)
        assert ref.generate([jobs[rid]], sp)[0].outputs[0].token_ids == results[rid], rid


def test_cli_flag_turns_caching_off() -> None:
    args = build_parser().parse_args(["serve", "--no-prefix-caching"])
    assert engine_config(args).enable_prefix_caching is False
    assert engine_config(build_parser().parse_args(["serve"])).enable_prefix_caching is True


# -- serving ----------------------------------------------------------------------------------------


def test_metrics_and_usage_report_cached_tokens(live_server: LiveServer) -> None:
    body = {"model": live_server.name, "prompt": list(range(3, 3 + 40)), "max_tokens": 3, "temperature": 0}

    def counters() -> tuple[float, float]:
        text = httpx.get(live_server.url + "/metrics").text
        vals = {}
        for line in text.splitlines():
            for name in ("tokenloom:prefix_cache_queries_total", "tokenloom:prefix_cache_hits_total"):
                if line.startswith(name + "{"):
                    vals[name] = float(line.rsplit(" ", 1)[1])
        return vals["tokenloom:prefix_cache_queries_total"], vals["tokenloom:prefix_cache_hits_total"]

    q0, h0 = counters()
    httpx.post(live_server.url + "/v1/completions", json=body, timeout=60).raise_for_status()
    r = httpx.post(live_server.url + "/v1/completions", json=body, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # 2 full blocks of 16; token 40 recomputed
    q1, h1 = counters()
    assert q1 - q0 == 80 and h1 - h0 >= 32
    body["stream"], body["stream_options"] = True, {"include_usage": True}
    with httpx.stream("POST", live_server.url + "/v1/completions", json=body, timeout=60) as s:
        lines = [line for line in s.iter_lines() if '"usage"' in line]
    assert '"cached_tokens": 32' in lines[-1] or '"cached_tokens":32' in lines[-1]
