"""Speculative decoding: n-gram, draft-model and self-draft proposals verified by the target, greedy
outputs unchanged, rejection sampling exact in distribution, stops and limits exact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, make_tiny_model
from tokenloom import LLM, SamplingParams
from tokenloom.engine.sampler import Sampler
from tokenloom.engine.sequence import Sequence
from tokenloom.errors import ConfigError
from tokenloom.spec.ngram import lookup
from tokenloom.spec.verify import verify, verify_batch

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
KW = dict(dtype="float32", kv_cache_memory="8MiB", max_model_len=256)


def _ids(outs: list) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> list[list[int]]:
    return _ids(LLM(str(tiny_llama), **KW).generate(PROMPTS, GREEDY))


def test_ngram_lookup_takes_the_longest_most_recent_match() -> None:
    assert lookup([1, 2, 3, 4, 1, 2], 3, 4, 1) == [3, 4, 1]
    assert lookup([5, 1, 9, 1, 7, 1], 2, 4, 1) == [7, 1]  # most recent earlier "1" is at index 3
    assert lookup([1, 2, 3], 3, 4, 2) == []  # no earlier bigram
    assert lookup([7, 8, 9, 7, 8], 5, 4, 1) == [9, 7, 8]  # fewer than k tokens follow the match


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_greedy_outputs_identical_with_speculation(tiny_llama: Path, baseline: list[list[int]], method: str) -> None:
    extra = {"ngram": {}, "self": {"draft_layers": 1}, "draft": {"draft_model": str(tiny_llama)}}[method]
    llm = LLM(str(tiny_llama), speculative=method, num_speculative_tokens=3, **extra, **KW)
    assert _ids(llm.generate(PROMPTS, GREEDY)) == baseline
    s = llm.stats()
    assert s["spec_decode_num_drafts"] > 0 and s["spec_decode_draft_tokens"] > 0
    if method == "draft":  # the draft is the target itself: every greedy draft is the target's argmax
        assert s["spec_decode_acceptance_rate"] == 1.0
        assert s["spec_decode_mean_accepted_length"] > 3.0
    llm.engine.kv.pool.check_invariants()
    assert llm.engine.kv.pool.num_used == 0


def test_draft_equal_to_target_accepts_sampled_drafts(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), speculative="draft", draft_model=str(tiny_llama), num_speculative_tokens=4, **KW)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=40, ignore_eos=True)
    llm.generate(PROMPTS, sp)
    # p == q up to float rounding: acceptance min(1, p/q) is 1 but for the rare draw within rounding of it.
    assert llm.stats()["spec_decode_acceptance_rate"] > 0.99


def test_mixed_batch_of_speculating_and_plain_requests(tiny_llama: Path) -> None:
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), GREEDY]
    plain = LLM(str(tiny_llama), **KW)
    spec = LLM(str(tiny_llama), speculative="draft", draft_model=str(tiny_llama), num_speculative_tokens=3, **KW)
    assert _ids(spec.generate(PROMPTS, params)) == _ids(plain.generate(PROMPTS, params))
    assert [len(t) for t in _ids(spec.generate(PROMPTS, params))] == [24, 24, 24, 5, 24]


def test_stop_string_inside_an_accepted_run_stops_exactly_there(tiny_llama: Path) -> None:
    plain = LLM(str(tiny_llama), **KW)
    spec = LLM(str(tiny_llama), speculative="draft", draft_model=str(tiny_llama), num_speculative_tokens=6, **KW)
    prompt = PROMPTS[1]
    full = plain.generate([prompt], GREEDY)[0].outputs[0]
    tok = plain.tokenizer
    # A stop string made of output tokens 7..8: every verification step accepts all 6 drafts, so it
    # falls inside an accepted run, never at its end.
    stop = tok.decode(full.token_ids[7:9])
    assert stop.strip() and stop in full.text
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = plain.generate([prompt], sp)[0].outputs[0]
    got = spec.generate([prompt], sp)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)
    assert got.token_ids == want.token_ids
    spec.engine.kv.pool.check_invariants()


def test_logprobs_and_max_tokens_with_speculation(tiny_llama: Path) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=2)
    plain = LLM(str(tiny_llama), **KW).generate(PROMPTS[:3], sp)
    spec = LLM(str(tiny_llama), speculative="self", draft_layers=1, num_speculative_tokens=4, **KW).generate(PROMPTS[:3], sp)
    for a, b in zip(plain, spec):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids and len(cb.token_ids) == 17 and cb.finish_reason == "length"
        assert [lp.token_id for lp in cb.logprobs] == cb.token_ids
        for x, y in zip(ca.logprobs, cb.logprobs):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert list(y.top) == list(x.top)


def test_bad_speculative_config(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--speculative draft"):
        LLM(str(tiny_llama), speculative="draft", **KW)
    with pytest.raises(ConfigError, match="must be one of"):
        LLM(str(tiny_llama), speculative="medusa", **KW)
    with pytest.raises(ConfigError, match="fewer than the model's 2 layers"):
        LLM(str(tiny_llama), speculative="self", draft_layers=2, **KW)
    other = make_tiny_model(tmp_path / "other-vocab", vocab_size=512)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(tiny_llama), speculative="draft", draft_model=str(other), **KW)


# -- the rejection sampler's distribution -------------------------------------------------------------


def _fake_seq(params: SamplingParams, drafts: list[int], q: torch.Tensor | None, seed: int) -> Sequence:
    g = torch.Generator()
    g.manual_seed(seed)
    seq = Sequence("s", "s", 0, [0], params, 100, frozenset(), 0, generator=g)
    seq.spec.token_ids, seq.spec.draft_probs = drafts, q
    return seq


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_rejection_sampling_preserves_the_target_distribution(draft_kind: str) -> None:
    """Marginal of the first emitted token must be the target's p_0, whatever the draft does."""
    torch.manual_seed(0)
    vocab, k, trials = 6, 2, 12000
    logits = torch.randn(k + 1, vocab) * 1.5  # target
    params = SamplingParams(temperature=1.0, max_tokens=10)
    p0 = torch.softmax(logits[0], -1)
    q = torch.softmax(torch.randn(k, vocab) * 1.5, -1)  # a draft distribution unlike the target's
    sampler = Sampler(seed=0)
    rng = random.Random(0)
    counts = torch.zeros(vocab)
    accepted = 0
    for t in range(trials):
        if draft_kind == "model":
            drafts = [int(torch.multinomial(q[i], 1, generator=sampler.generator)) for i in range(k)]
            seq = _fake_seq(params, drafts, q, t)
        else:
            drafts = [rng.randrange(vocab) for _ in range(k)]  # any fixed guess: q is one-hot on it
            seq = _fake_seq(params, drafts, None, t)
        out = verify(seq, logits, sampler)
        counts[out.token_ids[0]] += 1
        accepted += out.num_accepted
    freq = counts / trials
    tv = 0.5 * float((freq - p0).abs().sum())
    chi2 = float(((counts - trials * p0) ** 2 / (trials * p0)).sum())
    assert tv < 0.02, (freq, p0)
    assert chi2 < 25.0  # 5 degrees of freedom: p < 0.001 beyond ~20.5
    assert 0 < accepted < trials * k  # some drafts accepted, some rejected


def test_a_sampler_that_ignores_rejection_fails_the_same_check() -> None:
    """The check above has power: always accepting the drafts yields the draft's distribution."""
    torch.manual_seed(0)
    vocab, trials = 6, 12000
    p0 = torch.softmax(torch.randn(vocab) * 1.5, -1)
    q0 = torch.softmax(torch.randn(vocab) * 1.5, -1)
    g = torch.Generator()
    g.manual_seed(0)
    draws = torch.multinomial(q0, trials, replacement=True, generator=g)
    freq = torch.bincount(draws, minlength=vocab).float() / trials
    assert 0.5 * float((freq - p0).abs().sum()) > 0.02


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, 5), -5.0)
    for row, tok in enumerate([3, 1, 4, 2]):
        logits[row, tok] = 5.0
    seq = _fake_seq(SamplingParams(temperature=0.0), [3, 1, 0], None, 0)
    out = verify(seq, logits, Sampler())
    assert (out.token_ids, out.num_accepted) == ([3, 1, 4], 2)
    seq = _fake_seq(SamplingParams(temperature=0.0), [3, 1, 4], None, 0)
    assert verify(seq, logits, Sampler()).token_ids == [3, 1, 4, 2]


def test_one_sampling_batch_serves_plain_and_verifying_rows() -> None:
    """prepare() maps each logits row to its sequence once: plain rows sample one token, a sequence with
    k drafts owns k + 1 rows and verifies; both read the same SamplingBatch."""
    vocab = 6
    want = [4, 3, 1, 5, 2]  # each logits row's argmax
    logits = torch.full((len(want), vocab), -5.0)
    for r, t in enumerate(want):
        logits[r, t] = 5.0
    plain = _fake_seq(SamplingParams(temperature=0.0), [], None, 0)
    spec = _fake_seq(SamplingParams(temperature=0.0, logprobs=0), [3, 0], None, 0)  # d_1 = 3 matches, d_2 = 0 not
    last = _fake_seq(SamplingParams(temperature=0.0, logprobs=1), [], None, 0)
    sampler = Sampler()
    batch = sampler.prepare([plain, spec, last], [0, 1, 1, 1, 2])
    assert (batch.batch_rows, batch.logit_rows) == ([0, 2], [0, 4])
    assert [(v.batch_row, v.start, v.end) for v in batch.verify] == [(1, 1, 4)]
    out = sampler.sample(batch, logits)
    assert out.token_ids == [4, None, 2]
    assert out.logprobs[0] is None and out.logprobs[2] is not None and list(out.logprobs[2].top) == [2]
    runs = verify_batch(batch, logits, sampler)
    assert list(runs) == [1] and (runs[1].token_ids, runs[1].num_accepted) == ([3, 1], 1)
    assert [lp.token_id for lp in runs[1].logprobs] == [3, 1]


@pytest.mark.parametrize("method", ["draft", "self"])
def test_tight_token_budget_cuts_drafts_without_harm(tiny_llama: Path, baseline: list[list[int]], method: str) -> None:
    """With a budget of 8 tokens for 4 sequences, drafts get cut short or dropped and sequences sit out
    steps; outputs stay the same and no slot stays reserved."""
    extra = {"draft": {"draft_model": str(tiny_llama)}, "self": {"draft_layers": 1}}[method]
    llm = LLM(str(tiny_llama), speculative=method, num_speculative_tokens=6, max_num_seqs=4,
              max_num_batched_tokens=8, **extra, **KW)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(llm.tokenizer.encode(p), GREEDY, request_id=str(i))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(t for c in out.outputs for t in c.token_ids)
        eng.kv.pool.check_invariants()
        for seq in eng.scheduler.running:  # a running sequence holds blocks for its tokens + its drafts
            need = -(-(seq.num_tokens + len(seq.spec.token_ids)) // eng.kv.block_size)
            assert len(seq.block_ids) <= need
            assert seq.spec.draft_num_computed <= seq.num_tokens - 1 + len(seq.spec.token_ids)
    assert [got[str(i)] for i in range(len(PROMPTS))] == baseline
    assert eng.kv.pool.num_used == 0
