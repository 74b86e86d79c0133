"""Logits processors: what happens to a row's logits before the argmax or the temperature, per request.

In vLLM's order: logit_bias -> allowed_token_ids -> bad words -> min_tokens stop mask -> repetition /
presence / frequency penalties (`process`), then the output grammar's token bitmask (`apply_grammar`). Only
the rows whose request needs them are processed (`needs_processing`); a batch without such rows skips all
of it. A verifying sequence's k + 1 rows are processed as if the drafts before each row were already its
tokens (`process_run`, used by spec/verify.py). The raw logits are never written: logprobs come from them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tokenloom.engine.sequence import Sequence
from tokenloom.errors import InvalidRequest
from tokenloom.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowContext:
    """What processing one logits row reads: its request's parameters and the tokens before its position
    (a plain row: the sequence's tokens; a verifying row i: those followed by the drafts before i)."""

    params: SamplingParams
    token_ids: Seq[int]  # prompt + output so far
    prompt_len: int
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) + the request's stop_token_ids

    @classmethod
    def of(cls, seq: Sequence) -> RowContext:
        return cls(seq.params, seq.token_ids, seq.prompt_len, seq.stop_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def min_tokens_pending(self) -> bool:
        """Stop tokens may not be sampled yet (min_tokens)."""
        return self.num_output_tokens < self.params.min_tokens and bool(self.stop_token_ids)


def needs_processing(s: Sequence) -> bool:
    """Whether `s`'s logits row is processed this step: its request's logit_bias, allowed_token_ids, bad
    words or penalties (SamplingParams.needs_logits_processing, cached per request), or a pending min_tokens."""
    p = s.params
    return p.needs_logits_processing or (s.num_output_tokens < p.min_tokens and bool(s.stop_token_ids))



def process_run(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """A verifying sequence's (k + 1, vocab) logits, processed as `sample` processes a plain row's: row i
    as if the drafts before it were already the sequence's tokens (what bad words, a pending min_tokens
    and penalties see there). Returns `logits` itself when nothing applies, else a processed copy; the
    raw rows stay the caller's, for logprobs."""
    drafts = seq.spec.token_ids
    rows = logits.shape[0]  # k + 1
    if not (seq.params.needs_logits_processing or RowContext.of(seq).min_tokens_pending):
        return logits
    tokens = list(seq.token_ids)
    ctxs = [RowContext(seq.params, tokens + list(drafts[:i]), seq.prompt_len, seq.stop_token_ids)
            for i in range(rows)]
    out = logits.clone()
    process(out, ctxs)
    return out

def process(logits: torch.Tensor, ctxs: Seq[RowContext]) -> None:
    """Everything before the argmax / temperature, in place on (R, vocab) `logits` (row i: ctxs[i]), in
    vLLM's order: logit_bias -> allowed_token_ids -> bad words -> min_tokens stop mask -> penalties. Raises
    InvalidRequest for a row whose bans leave no token (its request fails alone: engine._sample_each)."""
    logit_bias(logits, ctxs)
    allowed_token_ids(logits, ctxs)
    ban_bad_words(logits, ctxs)
    mask_stop_tokens(logits, ctxs)
    penalties(logits, ctxs)
    # A row of -inf would sample garbage (NaN probabilities), or silently token 0 when greedy.
    if any(c.params.allowed_token_ids is not None or c.params.bad_words_token_ids or c.min_tokens_pending
           for c in ctxs):
        dead = torch.isneginf(logits).all(dim=-1).nonzero().flatten().tolist()
        if dead:
            p = ctxs[dead[0]].params
            field_name = "allowed_token_ids" if p.allowed_token_ids is not None else "bad_words_token_ids"
            raise InvalidRequest(
                "no token may be sampled: allowed_token_ids, bad_words_token_ids and min_tokens (stop tokens "
                "banned until then) together exclude the whole vocabulary", field_name,
            )

def logit_bias(logits: torch.Tensor, ctxs: Seq[RowContext]) -> None:
    # One scatter-add for every row's biases; ids past the vocabulary are ignored (the engine rejects them).
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, c in enumerate(ctxs):
        bias = c.params.logit_bias
        if bias:
            rows.extend([i] * len(bias))
            ids, values = zip(*bias)
            cols.extend(ids)
            vals.extend(values)
    if not rows:
        return
    device = logits.device
    r = torch.tensor(rows, dtype=torch.long, device=device)
    t = torch.tensor(cols, dtype=torch.long, device=device)
    v = torch.tensor(vals, dtype=logits.dtype, device=device)
    keep = t < logits.shape[1]
    logits.index_put_((r[keep], t[keep]), v[keep], accumulate=True)  # ids are unique per row (SamplingParams)

def allowed_token_ids(logits: torch.Tensor, ctxs: Seq[RowContext]) -> None:
    """-inf for every token outside each row's allowed_token_ids."""
    idx = [i for i, c in enumerate(ctxs) if c.params.allowed_token_ids is not None]
    if not idx:
        return
    device, vocab = logits.device, logits.shape[1]
    allowed = [c.params.allowed_token_ids or () for c in (ctxs[i] for i in idx)]
    r = torch.tensor([j for j, ids in enumerate(allowed) for _ in ids], dtype=torch.long, device=device)
    t = torch.tensor([t for ids in allowed for t in ids], dtype=torch.long, device=device)
    keep = t < vocab
    banned = torch.ones((len(idx), vocab), dtype=torch.bool, device=device)  # (A, vocab)
    banned[r[keep], t[keep]] = False
    rows = torch.tensor(idx, dtype=torch.long, device=device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(banned, float("-inf")))

def ban_bad_words(logits: torch.Tensor, ctxs: Seq[RowContext]) -> None:
    """vLLM's NoBadWordsLogitsProcessor: a one-token bad word is banned always; a longer one's last token when
    the output so far (not the prompt, as vLLM) ends with its first len - 1 tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, c in enumerate(ctxs):
        words = c.params.bad_words_token_ids
        if not words:
            continue
        out_len = c.num_output_tokens
        # The output's last (longest word - 1) tokens: all a prefix can match (never prompt tokens).
        longest = max(len(w) for w in words) - 1
        tail = tuple(c.token_ids[len(c.token_ids) - min(longest, out_len):]) if longest else ()
        for w in words:
            n = len(w) - 1
            if n == 0 or (n <= len(tail) and tail[len(tail) - n:] == w[:n]):
                rows.append(i)
                cols.append(w[-1])
    if rows:
        device = logits.device
        r = torch.tensor(rows, dtype=torch.long, device=device)
        t = torch.tensor(cols, dtype=torch.long, device=device)
        keep = t < logits.shape[1]
        logits[r[keep], t[keep]] = float("-inf")

def mask_stop_tokens(logits: torch.Tensor, ctxs: Seq[RowContext]) -> None:
    """min_tokens: stop tokens (EOS and the request's stop_token_ids) cannot be sampled yet."""
    vocab = logits.shape[1]
    for i, c in enumerate(ctxs):
        if c.min_tokens_pending:
            ids = [t for t in c.stop_token_ids if t < vocab]
            if ids:
                logits[i, ids] = float("-inf")

def penalties(logits: torch.Tensor, ctxs: Seq[RowContext]) -> None:
    vocab = logits.shape[1]
    for i, c in enumerate(ctxs):
        p = c.params
        window = p.repetition_window
        if p.repetition_penalty != 1.0 and window != 0:
            # HF/CTRL: every token seen in prompt or output (the last `window` of them when set); positive
            # logits divided, negative multiplied.
            recent = c.token_ids if window is None else c.token_ids[-window:]
            seen = torch.tensor(sorted(set(recent)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            row = logits[i, seen]
            logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and c.num_output_tokens:
            out = torch.tensor(c.token_ids[c.prompt_len :], dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)

def apply_grammar(logits: torch.Tensor, seqs: Seq[Sequence], rows: list[int]) -> None:
    """One token bitmask for the step: each constrained row's matcher writes its allowed tokens, then one
    batched call sets every other token of those rows to -inf (unconstrained rows are not touched)."""
    from tokenloom.structured import allocate, apply  # the grammar engine loads with its first user

    bitmask = allocate(logits.shape[0], logits.shape[1])  # (P, ceil(vocab / 32)) int32, all allowed
    for r in rows:
        constraint = seqs[r].constraint
        if constraint is not None:
            constraint.fill(bitmask, r)
    apply(logits, bitmask, rows)
    # A grammar always allows some token (a stop token once complete); only a row that also bans tokens
    # (allowed_token_ids, bad words) can be left with none.
    banning = [r for r in rows if seqs[r].params.allowed_token_ids is not None or seqs[r].params.bad_words_token_ids]
    if banning and bool(torch.isneginf(logits[banning]).all(dim=-1).any()):
        raise InvalidRequest("the output constraint leaves no token the request's other settings allow",
                             "structured_outputs")
