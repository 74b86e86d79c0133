"""Verification of draft tokens against the target's logits, for one sequence.

The target ran k + 1 positions in one forward: the sequence's last token and its k drafts d_1..d_k, so
row i of the logits is the target's distribution p_i for the token after d_i (row 0: after the last
token). Greedy requests keep the longest prefix of drafts equal to the target's argmax, then the
argmax at the first mismatch (or after d_k): exactly the tokens greedy decoding would produce.
Sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): d_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); the first rejected position samples from
normalize(max(0, p_i - q_i)); if all are accepted a bonus token comes from p_k. Every emitted token is
then distributed exactly as under the target alone. n-gram drafts are deterministic (q = one-hot).
"""

from __future__ import annotations

import torch

from tokenloom.engine.logits_processors import process_run
from tokenloom.engine.sampler import Sampler, SamplingArgs, SamplingBatch, Verified, logprobs_of
from tokenloom.engine.sequence import Sequence
from tokenloom.outputs import TokenLogprob


def can_speculate(seq: Sequence) -> bool:
    """Penalties, a pending min_tokens and an output grammar make each position's distribution depend on
    the tokens before it inside the draft run; such requests decode one token at a time (in the same
    batch). Constrained requests would need a mask per draft position and a matcher rollback."""
    p = seq.params
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and seq.num_output_tokens >= p.min_tokens and seq.constraint is None)


def verify_batch(batch: SamplingBatch, logits: torch.Tensor, sampler: Sampler) -> dict[int, Verified]:
    """Every verifying sequence of the step (batch.verify, in batch order): batch row -> its run."""
    return {v.batch_row: verify(v.seq, logits[v.start : v.end], sampler, v.args) for v in batch.verify}


def verify(seq: Sequence, logits: torch.Tensor, sampler: Sampler, args: SamplingArgs | None = None) -> Verified:
    """logits: (k + 1, vocab) float32 target logits for the sequence's last token and its k drafts;
    `args`: the request's sampling parameters for those k + 1 rows (made here when not given)."""
    drafts = seq.spec.token_ids
    k = len(drafts)
    # logit_bias, allowed_token_ids and bad words, per position as if the drafts before it were accepted
    # (the raw `logits` stay for logprobs).
    processed = process_run(seq, logits)  # (k + 1, vocab)
    if seq.params.greedy:
        target = processed.argmax(dim=-1).tolist()  # (k + 1,)
        a = 0
        while a < k and target[a] == drafts[a]:
            a += 1
        tokens = drafts[:a] + [target[a]]
    else:
        tokens = _rejection_sample(seq, processed, sampler,
                                   args or SamplingArgs.of([seq] * (k + 1), logits.device))
        a = len(tokens) - 1
    want = seq.params.logprobs
    lps: list[TokenLogprob | None] = [None] * len(tokens)
    if want is not None:
        lps = logprobs_of(logits[: len(tokens)], tokens, [want] * len(tokens))
    return Verified(tokens, lps, a)


def _rejection_sample(seq: Sequence, logits: torch.Tensor, sampler: Sampler, args: SamplingArgs) -> list[int]:
    drafts = seq.spec.token_ids
    k = len(drafts)
    p = Sampler.probs_from(args, logits)  # (k + 1, vocab), the request's temperature/top-k/top-p/min-p
    q = seq.spec.draft_probs  # (k, vocab), or None: deterministic drafts
    gen = seq.generator if seq.generator is not None else sampler.generator
    u = torch.rand(k, generator=gen, device=p.device, dtype=p.dtype) if k else p.new_empty(0)
    for i, d in enumerate(drafts):
        q_d = q[i, d] if q is not None else p.new_tensor(1.0)
        if bool(u[i] * q_d <= p[i, d]):  # u < p/q, without dividing by a zero q
            continue
        residual = (p[i] - q[i]).clamp_min(0.0) if q is not None else p[i].clone()
        if q is None:
            residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p[i]
        return drafts[:i] + [sampler.draw(residual[None, :], [seq])[0]]
    return list(drafts) + [sampler.draw(p[k:], [seq])[0]]
