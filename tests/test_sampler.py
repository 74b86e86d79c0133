"""Sampler: each processing step against a direct computation, and the sampled distribution."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from tokenloom.engine.sampler import Sampler
from tokenloom.engine.sequence import Sequence
from tokenloom.errors import InvalidRequest
from tokenloom.outputs import TokenLogprob
from tokenloom.sampling_params import SamplingParams

VOCAB = 8


def seq(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
        stop_ids: frozenset[int] = frozenset(), seed: int | None = None) -> Sequence:
    gen = None
    if seed is not None:
        gen = torch.Generator()
        gen.manual_seed(seed)
    s = Sequence("s", "s", 0, prompt or [0], params, 100, stop_ids, 0, generator=gen)
    s.token_ids.extend(output or [])
    return s


def logits_row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


class Drawn(NamedTuple):
    token_id: int
    logprob: TokenLogprob | None


def draw(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> list[Drawn]:
    """One step of the engine's sampling path: prepare the batch (one logits row per sequence), sample."""
    out = sampler.sample(sampler.prepare(seqs, list(range(len(seqs)))), logits)
    return [Drawn(t, lp) for t, lp in zip(out.token_ids, out.logprobs)]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": "abc"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field and field in str(e.value)


def test_greedy_and_top_k_1_pick_the_max() -> None:
    row = logits_row([0.1, 2.0, 0.3, 1.9, -1, 0, 0, 0])
    s = Sampler()
    assert draw(s, row, [seq(SamplingParams(temperature=0))])[0].token_id == 1
    assert draw(s, row, [seq(SamplingParams(temperature=1.0, top_k=1))])[0].token_id == 1
    assert draw(s, row, [seq(SamplingParams(temperature=1.0, top_p=0.01))])[0].token_id == 1


def test_repetition_presence_frequency_penalties() -> None:
    row = logits_row([2.0, 1.8, -1.0, 0, 0, 0, 0, 0])
    s = Sampler()
    # token 0 seen in the prompt: 2.0 / 1.5 = 1.33 < 1.8, so greedy moves to token 1.
    assert draw(s, row, [seq(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0])])[0].token_id == 1
    # presence: only output tokens count; 2.0 - 0.5 = 1.5 < 1.8.
    assert draw(s, row, [seq(SamplingParams(temperature=0, presence_penalty=0.5), prompt=[0])])[0].token_id == 0
    assert draw(s, row, [seq(SamplingParams(temperature=0, presence_penalty=0.5), output=[0])])[0].token_id == 1
    # frequency: 2.0 - 3 * 0.1 = 1.7 < 1.8.
    assert draw(s, row, [seq(SamplingParams(temperature=0, frequency_penalty=0.1), output=[0, 0, 0])])[0].token_id == 1
    assert draw(s, row, [seq(SamplingParams(temperature=0, frequency_penalty=0.1), output=[0])])[0].token_id == 0


def test_min_tokens_masks_stop_tokens() -> None:
    row = logits_row([0, 0, 9.0, 0, 0, 0, 0, 0])  # token 2 (EOS) is by far the most likely
    s = Sampler()
    early = seq(SamplingParams(temperature=0, min_tokens=3), stop_ids=frozenset({2}))
    assert draw(s, row, [early])[0].token_id != 2
    late = seq(SamplingParams(temperature=0, min_tokens=3), output=[5, 5, 5], stop_ids=frozenset({2}))
    assert draw(s, row, [late])[0].token_id == 2


def test_min_p_removes_unlikely_tokens() -> None:
    row = logits_row([5.0, 4.9, 0, 0, 0, 0, 0, 0])
    s = Sampler(seed=0)
    picks = {draw(s, row, [seq(SamplingParams(temperature=1.0, min_p=0.5))])[0].token_id for _ in range(200)}
    assert picks == {0, 1}


def test_logprobs_are_raw_model_logprobs() -> None:
    row = logits_row([1.0, 2.0, 3.0, 0.5, 0, 0, 0, -1])
    res = draw(Sampler(), row, [seq(SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0), prompt=[2])])[0]
    ref = torch.log_softmax(row[0], -1)
    assert res.logprob is not None
    assert res.logprob.logprob == pytest.approx(float(ref[res.token_id]))
    assert list(res.logprob.top) == [2, 1, 0]
    assert res.logprob.top[2] == pytest.approx(float(ref[2]))
    assert res.logprob.rank == 1 + int((ref > ref[res.token_id]).sum())


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    row = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [draw(Sampler(seed=1), row, [seq(params, seed=7)])[0].token_id for _ in range(1)]
    crowd_rows = torch.cat([torch.randn(3, VOCAB), row])
    a = seq(params, seed=7)
    got = draw(Sampler(seed=2), crowd_rows, [seq(SamplingParams(temperature=1.0)) for _ in range(3)] + [a])[3].token_id
    assert got == alone[0]


def test_sampled_distribution_matches_softmax() -> None:
    """Chi-square goodness of fit over 20k seeded draws; a wrong sampler fails by a wide margin."""
    torch.manual_seed(0)
    row = torch.randn(1, VOCAB) * 1.5
    temperature = 0.7
    expected = torch.softmax(row[0] / temperature, -1)
    s = Sampler(seed=123)
    n = 20000
    batch = row.repeat(n, 1)
    draws = draw(s, batch, [seq(SamplingParams(temperature=temperature)) for _ in range(n)])
    counts = torch.bincount(torch.tensor([d.token_id for d in draws]), minlength=VOCAB).float()
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001.
    assert chi2 < 24.3


def test_top_p_keeps_smallest_prefix() -> None:
    # probs ~ [0.5, 0.3, 0.2]: top_p=0.6 keeps {0, 1}; top_p=0.5 keeps {0} only.
    row = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * 5]))
    s = Sampler(seed=0)
    picks = {draw(s, row, [seq(SamplingParams(temperature=1.0, top_p=0.6))])[0].token_id for _ in range(300)}
    assert picks == {0, 1}
    picks = {draw(s, row, [seq(SamplingParams(temperature=1.0, top_p=0.5))])[0].token_id for _ in range(100)}
    assert picks == {0}
