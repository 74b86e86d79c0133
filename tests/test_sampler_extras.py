"""Sampler extras: logit_bias, allowed_token_ids, bad words, typical-p and the repetition window, each against
a direct computation; rows without them sample exactly as in a batch without the rows that have them."""

from __future__ import annotations

import math

import pytest
import torch

from test_sampler import seq
from tokenloom.engine.logits_processors import RowContext, process, process_run
from tokenloom.engine.sampler import Sampler, SamplingArgs
from tokenloom.engine.sequence import Sequence
from tokenloom.errors import InvalidRequest
from tokenloom.sampling_params import SamplingParams

VOCAB = 8


def row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)  # (1, vocab)


def tokens(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
    """One step of the engine's sampling path (one logits row per sequence)."""
    return sampler.sample(sampler.prepare(seqs, list(range(len(seqs)))), logits).token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: -101}}, "logit_bias"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {1: "x"}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
        ({"logit_bias": {2**63: 1.0}}, "logit_bias"),
        ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"),
        ({"logit_bias": 3}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"allowed_token_ids": 4}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[1, -1]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [3]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": "ab"}, "bad_words_token_ids"),
        ({"typical_p": 0.0}, "typical_p"),
        ({"typical_p": 1.01}, "typical_p"),
        ({"typical_p": float("nan")}, "typical_p"),
        ({"repetition_window": -1}, "repetition_window"),
        ({"repetition_window": 2.0}, "repetition_window"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field and field in str(e.value)


def test_lists_and_dicts_are_frozen() -> None:
    p = SamplingParams(logit_bias={5: 1.0, 2: -3}, allowed_token_ids=[3, 1], bad_words_token_ids=[[4], [1, 2]])
    assert p.logit_bias == ((2, -3), (5, 1.0))
    assert p.allowed_token_ids == (3, 1) and p.bad_words_token_ids == ((4,), (1, 2))
    assert SamplingParams(logit_bias=[[5, 1.0], (2, -3)]) == p.__class__(logit_bias={2: -3, 5: 1.0})
    hash(p)  # frozen: usable as a key
    assert not SamplingParams().needs_logits_processing
    assert not SamplingParams(typical_p=0.5, repetition_penalty=1.3, repetition_window=0).needs_logits_processing
    assert p.needs_logits_processing and SamplingParams(repetition_penalty=1.3).needs_logits_processing


def test_logit_bias_forces_and_bans_greedily() -> None:
    logits = row([0.1, 2.0, 0.3, 1.9, -1, 0, 0, 0])
    s = Sampler()
    assert tokens(s, logits, [seq(SamplingParams(temperature=0, logit_bias={6: 100}))]) == [6]
    assert tokens(s, logits, [seq(SamplingParams(temperature=0, logit_bias={1: -100}))]) == [3]
    # Sampled too: +100 leaves the others e^-100 of the mass.
    assert {tokens(s, logits, [seq(SamplingParams(temperature=1.0, logit_bias={4: 100}))])[0]
            for _ in range(50)} == {4}
    # Ids past the vocabulary are the engine's to reject: the sampler ignores them.
    assert tokens(s, logits, [seq(SamplingParams(temperature=0, logit_bias={100: 100}))]) == [1]


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    logits = row([1.0, 2.0, 3.0, 0.5, 0, 0, 0, -1])
    s = Sampler()
    out = s.sample(s.prepare([seq(SamplingParams(temperature=0, logprobs=2, logit_bias={7: 100}))], [0]), logits)
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [7] and lp is not None
    assert lp.logprob == pytest.approx(float(ref[7])) and lp.rank == VOCAB
    assert list(lp.top) == [2, 1] and lp.top[2] == pytest.approx(float(ref[2]))


def test_allowed_token_ids_restrict_every_draw() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, 0] = 8.0  # by far the most likely, and not allowed
    allowed = {2, 5, 6}
    s = Sampler(seed=1)
    params = SamplingParams(temperature=1.0, allowed_token_ids=sorted(allowed))
    picks = [tokens(s, logits, [seq(params, seed=i)])[0] for i in range(200)]
    assert set(picks) == allowed  # 200 draws over 3 tokens of comparable mass: each appears
    greedy = SamplingParams(temperature=0, allowed_token_ids=sorted(allowed))
    assert tokens(s, logits, [seq(greedy)]) == [max(allowed, key=lambda t: float(logits[0, t]))]


def test_bad_words_single_and_multi_token() -> None:
    logits = row([0, 0, 0, 5.0, 4.0, 0, 0, 0])  # 3 first, then 4
    s = Sampler()
    single = SamplingParams(temperature=0, bad_words_token_ids=[[3]])
    assert tokens(s, logits, [seq(single)]) == [4]
    assert tokens(s, logits, [seq(single, output=[1, 2])]) == [4]  # always
    multi = SamplingParams(temperature=0, bad_words_token_ids=[[1, 2, 3]])
    assert tokens(s, logits, [seq(multi)]) == [3]  # no prefix yet
    assert tokens(s, logits, [seq(multi, output=[1])]) == [3]  # half a prefix
    assert tokens(s, logits, [seq(multi, output=[7, 1, 2])]) == [4]  # the output ends with the prefix
    assert tokens(s, logits, [seq(multi, output=[1, 2, 0])]) == [3]  # it no longer does
    # As vLLM: the prefix must be in the output; prompt tokens do not complete it.
    assert tokens(s, logits, [seq(multi, prompt=[1, 2])]) == [3]


def test_typical_p_against_a_hand_computation() -> None:
    # p = [0.5, 0.3, 0.15, 0.05]: entropy H = 1.1422; |-ln p - H| = [0.449, 0.062, 0.755, 1.854], so the
    # typical order is 1, 0, 2, 3 with cumulative mass 0.3, 0.8, 0.95, 1.0.
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    h = -float((p * p.log()).sum())
    assert h == pytest.approx(1.1422, abs=1e-4)
    logits = p.log()[None, :]
    expected = {0.2: {1}, 0.5: {0, 1}, 0.85: {0, 1, 2}, 0.96: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for mass, keep in expected.items():
        probs = Sampler.probs([seq(SamplingParams(typical_p=mass))], logits)[0]
        assert {i for i in range(4) if probs[i] > 0} == keep, mass
        ref = torch.zeros(4)
        ref[sorted(keep)] = p[sorted(keep)] / p[sorted(keep)].sum()
        assert torch.allclose(probs, ref, atol=1e-6)
    # Through sample(): typical_p 0.2 always draws the most typical token, which is not the most likely.
    s = Sampler(seed=0)
    assert {tokens(s, logits, [seq(SamplingParams(typical_p=0.2))])[0] for _ in range(50)} == {1}


def test_typical_p_matches_transformers() -> None:
    warper_mod = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 2.0
    masses = [0.05, 0.2, 0.5, 0.8, 0.95, 0.99]
    args = SamplingArgs(torch.ones(6), [0] * 6, [1.0] * 6, torch.zeros(6), masses)
    probs = Sampler.probs_from(args, logits)
    for i, mass in enumerate(masses):
        ref = warper_mod.TypicalLogitsWarper(mass=mass)(torch.zeros(1, 1, dtype=torch.long), logits[i : i + 1])
        assert torch.equal(probs[i] > 0, torch.isfinite(ref[0])), mass
        assert torch.allclose(probs[i], ref.softmax(-1)[0], atol=1e-6)


def test_typical_p_rows_leave_other_rows_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    args = SamplingArgs(torch.ones(3), [0] * 3, [1.0, 0.9, 1.0], torch.zeros(3), [1.0, 1.0, 0.3])
    probs = Sampler.probs_from(args, logits)
    alone = Sampler.probs_from(SamplingArgs(torch.ones(1), [0], [1.0], torch.zeros(1), [1.0]), logits[:1])
    assert torch.equal(probs[0], alone[0])
    assert int((probs[2] > 0).sum()) < 50 and int((probs[1] > 0).sum()) < 50


def test_repetition_window_limits_the_penalty() -> None:
    logits = row([2.0, 1.9, 3.0, -1.0, 0.5, 0, 0, 0])
    prompt, output = [0, 1], [2, 3]  # tokens: 0 1 2 3
    s = Sampler()
    for window, seen in [(None, {0, 1, 2, 3}), (2, {2, 3}), (3, {1, 2, 3}), (10, {0, 1, 2, 3}), (0, set())]:
        params = SamplingParams(temperature=0, repetition_penalty=2.0, repetition_window=window)
        got = logits.clone()
        process(got, [RowContext.of(seq(params, prompt=prompt, output=output))])
        want = logits[0].clone()
        for t in seen:
            want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
        assert torch.equal(got[0], want), window
    # Greedy: token 2 (3.0) is penalized to 1.5 either way; token 0 (2.0) only when the window reaches it.
    inside = SamplingParams(temperature=0, repetition_penalty=2.0)
    outside = SamplingParams(temperature=0, repetition_penalty=2.0, repetition_window=2)
    assert tokens(s, logits, [seq(outside, prompt=prompt, output=output)]) == [0]
    assert tokens(s, logits, [seq(inside, prompt=prompt, output=output)]) == [2]  # 1.5 > 1.0, 0.95, 0.5


def test_plain_rows_do_not_depend_on_rows_with_extras() -> None:
    gen = torch.Generator().manual_seed(5)
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5),
             SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05), SamplingParams(temperature=1.2)]
    extras = [SamplingParams(temperature=0, logit_bias={3: 5.0}),
              SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3], typical_p=0.7),
              SamplingParams(temperature=0.7, bad_words_token_ids=[[4], [1, 2]], repetition_penalty=1.3,
                             repetition_window=3),
              SamplingParams(temperature=1.0, typical_p=0.5)]
    for step in range(20):
        plain_logits = torch.randn(len(plain), VOCAB, generator=gen)
        extra_logits = torch.randn(len(extras), VOCAB, generator=gen)
        alone = tokens(Sampler(seed=1), plain_logits, [seq(p, output=[1], seed=step * 10 + i)
                                                       for i, p in enumerate(plain)])
        # Interleaved: plain, extra, plain, extra, ...
        mixed_params = [p for pair in zip(plain, extras) for p in pair]
        mixed_logits = torch.stack([r for pair in zip(plain_logits, extra_logits) for r in pair])
        mixed_seqs = [seq(p, output=[1], seed=step * 10 + i // 2 if i % 2 == 0 else 1000 + step * 10 + i)
                      for i, p in enumerate(mixed_params)]
        got = tokens(Sampler(seed=2), mixed_logits, mixed_seqs)
        assert got[0::2] == alone, step
        # And each extras row draws what it draws alone.
        for j, p in enumerate(extras):
            i = 2 * j + 1
            one = tokens(Sampler(seed=3), extra_logits[j : j + 1], [seq(p, output=[1], seed=1000 + step * 10 + i)])
            assert got[i] == one[0], (step, j)


def test_process_run_processes_each_draft_position() -> None:
    """A verifying sequence's row i sees the drafts before i: the bad word (5, 6) bans 6 only after draft 5."""
    params = SamplingParams(temperature=0, bad_words_token_ids=[[5, 6]], logit_bias={2: -1.0})
    s = seq(params, output=[1])
    s.spec.token_ids = [5, 1]
    logits = torch.zeros(3, VOCAB)
    out = process_run(s, logits)
    assert torch.equal(logits, torch.zeros(3, VOCAB))  # the raw rows are untouched (logprobs)
    assert math.isinf(float(out[1, 6])) and float(out[0, 6]) == 0.0 and float(out[2, 6]) == 0.0
    assert torch.equal(out[:, 2], torch.full((3,), -1.0))
    plain = seq(SamplingParams(temperature=0))
    plain.spec.token_ids = [5]
    two = logits[:2]
    assert process_run(plain, two) is two  # nothing to do: no copy


def test_bans_that_leave_no_token_fail_the_request() -> None:
    params = SamplingParams(temperature=0, allowed_token_ids=[2], min_tokens=2)
    with pytest.raises(InvalidRequest) as e:
        tokens(Sampler(), torch.zeros(1, VOCAB), [seq(params, stop_ids=frozenset({2}))])
    assert e.value.field == "allowed_token_ids"
    params = SamplingParams(temperature=1.0, allowed_token_ids=[2], bad_words_token_ids=[[2]])
    with pytest.raises(InvalidRequest) as e:
        tokens(Sampler(), torch.zeros(1, VOCAB), [seq(params)])
