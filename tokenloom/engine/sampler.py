"""Turns each scheduled sequence's logits row into its next token, plus logprobs when asked.

Order of operations (as vLLM): the logits processors (engine/logits_processors.py: logit_bias,
allowed_token_ids, bad words, min_tokens mask, penalties, then the output grammar's bitmask; only on the
rows whose request needs them) -> greedy argmax, or temperature -> top-k -> top-p -> typical-p -> min-p ->
sample. Sampling uses the exponential race (argmax p_i / E_i, E_i ~ Exp(1)), drawing E from the request's
own generator when it has a seed, so a seeded request draws the same numbers whatever else is in the
batch. Logprobs are of the raw model distribution (log_softmax of the logits before any processing), as
the OpenAI API reports them.

Each step, `prepare` reads the batch's sequences once into a SamplingBatch (which logits rows sample and
which verify drafts, per-row parameters as tensors); `sample` (and spec/verify.py for verifying rows)
consume it. A verifying sequence's rows are processed by `logits_processors.process_run`, which
spec/verify.py applies before its argmax / rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from types import ModuleType

import torch

from tokenloom.engine import logits_processors as lp
from tokenloom.engine.sequence import Sequence
from tokenloom.outputs import TokenLogprob

LOGITS_DTYPE = torch.float32  # models/llama.py compute_logits: the sampler always sees float32 logits


@dataclass(frozen=True)
class SamplingArgs:
    """Temperature, top-k, top-p, typical-p and min-p of R rows, as the tensors `Sampler.probs` applies."""

    temperatures: torch.Tensor  # (R,) float32
    top_ks: list[int]  # (R,) vocab size where disabled, filled in by probs()
    top_ps: list[float]  # (R,)
    min_ps: torch.Tensor  # (R,) float32
    typical_ps: list[float]  # (R,) 1.0 where disabled

    @classmethod
    def of(cls, seqs: Seq[Sequence], device: torch.device) -> SamplingArgs:
        return cls(
            torch.tensor([s.params.temperature for s in seqs], dtype=LOGITS_DTYPE, device=device),
            [s.params.top_k for s in seqs],
            [s.params.top_p for s in seqs],
            torch.tensor([s.params.min_p for s in seqs], dtype=LOGITS_DTYPE, device=device),
            [s.params.typical_p for s in seqs],
        )


@dataclass(frozen=True)
class VerifyRow:
    """A sequence that verifies k drafts: its k + 1 logits rows [start, end)."""

    batch_row: int
    seq: Sequence
    start: int
    end: int
    args: SamplingArgs | None  # its sampling parameters repeated k + 1 times; None when greedy


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling work, read from the sequences once. "Plain" rows sample one token each."""

    num_rows: int  # S: rows of the scheduled batch
    seqs: list[Sequence]  # (P,) the sequence of each plain row
    batch_rows: list[int]  # (P,) its row in the scheduled batch
    logit_rows: list[int] | None  # (P,) its logits row; None: the logits are exactly the plain rows, in order
    greedy: list[int]  # indices into the P plain rows that take the argmax
    sampled: list[int]  # the others
    args: SamplingArgs | None  # of the `sampled` rows
    processed: list[int]  # indices into the P plain rows whose logits are processed (lp.needs_processing)
    constrained: list[int]  # indices into the P plain rows whose output grammar masks this step's tokens
    logprobs: list[int | None] | None  # (P,) top-N asked per plain row; None: no row asked
    verify: list[VerifyRow]  # sequences verifying drafts, in batch order

    @property
    def needs_processing(self) -> bool:
        return bool(self.processed)


@dataclass
class Verified:
    """A verifying sequence's new tokens: the drafts the target accepted, then one token of the target's."""

    token_ids: list[int]  # 1..k+1 tokens
    logprobs: list[TokenLogprob | None]
    num_accepted: int  # drafts accepted (len(token_ids) - 1)


@dataclass
class SamplerOutput:
    """One step's new tokens by batch row."""

    token_ids: list[int | None]  # (S,) the token of each plain row; None: no token (mid-prompt) or verifying
    logprobs: list[TokenLogprob | None]  # (S,) that token's logprob, where the request asked
    verified: dict[int, Verified] = field(default_factory=dict)  # batch row -> run, for verifying rows
    failed: dict[int, str] = field(default_factory=dict)  # batch row -> why sampling it raised

    def merge(self, other: SamplerOutput) -> None:
        """Take `other`'s rows (a sampling of other rows of the same batch)."""
        for b, t in enumerate(other.token_ids):
            if t is not None:
                self.token_ids[b], self.logprobs[b] = t, other.logprobs[b]
        self.verified.update(other.verified)
        self.failed.update(other.failed)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | None = None, kernels: ModuleType | None = None) -> None:
        self.device = torch.device(device or "cpu")
        # The C++ first_argmax (CPU kernels, when built): torch reduces one long row on one thread
        self.kernels = kernels if kernels is not None and hasattr(kernels, "first_argmax") else None
        # Requests without a seed share this generator: reproducible per engine run, not per request.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def prepare(self, seqs: Seq[Sequence], rows: list[int]) -> SamplingBatch:
        """`seqs`: the scheduled batch; `rows`: the batch row of each logits row (the runner's). A
        sequence with draft tokens owns k + 1 consecutive rows and verifies; any other owns one row."""
        if not any(s.spec.token_ids for s in seqs):  # one row per sampling sequence, in order
            plain_rows, logit_rows, verify = list(rows), None, []
        else:
            first: dict[int, int] = {}  # batch row -> its first logits row, in batch order
            count: dict[int, int] = {}
            for r, b in enumerate(rows):
                first.setdefault(b, r)
                count[b] = count.get(b, 0) + 1
            plain_rows = [b for b in first if not seqs[b].spec.token_ids]
            logit_rows = [first[b] for b in plain_rows]
            verify = [self._verify_row(b, seqs[b], first[b], first[b] + count[b]) for b in first
                      if seqs[b].spec.token_ids]
        plain = [seqs[b] for b in plain_rows]
        greedy = [i for i, s in enumerate(plain) if s.params.greedy]
        sampled = [i for i, s in enumerate(plain) if not s.params.greedy]
        want = [s.params.logprobs for s in plain]
        return SamplingBatch(
            num_rows=len(seqs), seqs=plain, batch_rows=plain_rows, logit_rows=logit_rows,
            greedy=greedy, sampled=sampled,
            args=SamplingArgs.of([plain[i] for i in sampled], self.device) if sampled else None,
            processed=[i for i, s in enumerate(plain) if lp.needs_processing(s)],
            constrained=[i for i, s in enumerate(plain) if s.constraint is not None and s.constraint.masks],
            logprobs=want if any(w is not None for w in want) else None,
            verify=verify,
        )

    def _verify_row(self, b: int, seq: Sequence, start: int, end: int) -> VerifyRow:
        args = None if seq.params.greedy else SamplingArgs.of([seq] * (end - start), self.device)
        return VerifyRow(b, seq, start, end, args)

    def sample(self, batch: SamplingBatch, logits: torch.Tensor) -> SamplerOutput:
        """logits: (rows, vocab) float32. Samples the plain rows; verifying rows are spec/verify.py's."""
        out = SamplerOutput([None] * batch.num_rows, [None] * batch.num_rows)
        if not batch.seqs:
            return out
        if batch.logit_rows is not None:
            logits = logits[batch.logit_rows]
        raw = logits
        seqs = batch.seqs
        if batch.processed:  # `raw` stays untouched for logprobs: process a copy
            ctxs = [lp.RowContext.of(seqs[i]) for i in batch.processed]
            if len(batch.processed) == len(seqs):
                logits = logits.clone()
                lp.process(logits, ctxs)
            else:  # only the rows that need it: (len(processed), vocab), written back into a copy
                rows = torch.tensor(batch.processed, dtype=torch.long, device=logits.device)
                sub = logits.index_select(0, rows)
                lp.process(sub, ctxs)
                logits = logits.index_copy(0, rows, sub)
        if batch.constrained:
            if logits is raw and batch.logprobs is not None:  # masked in place unless logprobs need `raw`
                logits = logits.clone()
            lp.apply_grammar(logits, seqs, batch.constrained)

        if batch.args is None:  # every plain row is greedy
            token_ids = self.argmax(logits)
        else:
            token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
            if batch.greedy:
                token_ids[batch.greedy] = self.argmax(logits[batch.greedy])
            probs = self.probs_from(batch.args, logits[batch.sampled])
            token_ids[batch.sampled] = self._sample(probs, [seqs[i] for i in batch.sampled])

        ids = token_ids.tolist()
        logprobs = logprobs_of(raw, ids, batch.logprobs) if batch.logprobs is not None else None
        for i, b in enumerate(batch.batch_rows):
            out.token_ids[b] = ids[i]
            if logprobs is not None:
                out.logprobs[b] = logprobs[i]
        return out

    @staticmethod
    def probs(seqs: Seq[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, typical-p, min-p of `seqs` (row i: seqs[i]); returns (S, vocab)
        probabilities."""
        return Sampler.probs_from(SamplingArgs.of(seqs, logits.device), logits)

    @staticmethod
    def probs_from(args: SamplingArgs, logits: torch.Tensor) -> torch.Tensor:
        """`probs` with the parameters already read (one row of `args` per row of `logits`)."""
        logits = logits / args.temperatures[:, None]
        vocab = logits.shape[1]
        top_ks = [k if 0 < k < vocab else vocab for k in args.top_ks]
        top_ps = args.top_ps
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            k = torch.tensor(top_ks, device=logits.device)[:, None]
            cut = ranks >= k  # beyond top-k
            sorted_probs = sorted_logits.softmax(dim=-1)
            p = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device)[:, None]
            # top-p keeps the smallest prefix whose mass reaches p: drop a token if the mass before it >= p.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            cut |= mass_before >= p
            cut[:, 0] = False  # the most likely token always survives
            sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        if any(t < 1.0 for t in args.typical_ps):
            logits = _typical(logits, args.typical_ps)
        probs = logits.softmax(dim=-1)
        min_ps = args.min_ps
        if bool((min_ps > 0).any()):
            threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def draw(self, probs: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        """One token per row of (unnormalized) `probs`, from each sequence's generator."""
        return self._sample(probs, seqs).tolist()

    def _sample(self, probs: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                (len(unseeded), probs.shape[1]), dtype=probs.dtype, device=probs.device
            ).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        return self.argmax(probs / noise)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """first_argmax, through the C++ kernel where it applies (float32 rows on CPU)."""
        if self.kernels is not None and x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1:
            return self.kernels.first_argmax(x)
        return first_argmax(x)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """(S, vocab) -> (S,) index of each row's largest value, the first one on ties (as argmax), in less
    than half argmax's time on CPU (docs/performance-notes.md#greedy-sampling)."""
    return x.max(dim=-1).indices


def _typical(logits: torch.Tensor, typical_ps: list[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022; HF's TypicalLogitsWarper, min_tokens_to_keep 1) on
    (R, vocab) logits already tempered and top-k/top-p filtered: keep the smallest set of tokens, taken by
    ascending |-log p - entropy|, whose mass reaches typical_p (ties at the boundary kept). Rows with
    typical_p 1 come back unchanged."""
    vocab = logits.shape[1]
    mass = torch.tensor(typical_ps, dtype=logits.dtype, device=logits.device)[:, None]  # (R, 1)
    logp = logits.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum(dim=-1, keepdim=True)  # (R, 1); -inf * 0 = NaN for filtered tokens
    shifted = (-logp - entropy).abs()  # (R, vocab); +inf for filtered tokens: they sort last
    sorted_shifted, order = shifted.sort(dim=-1)
    cum = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass).sum(dim=-1, keepdim=True).clamp_(max=vocab - 1)  # (R, 1) sorted index of the last kept
    remove = shifted > sorted_shifted.gather(-1, last)
    remove.scatter_(-1, order[:, :1], False)  # the most typical token always survives
    remove &= mass < 1.0
    return logits.masked_fill(remove, float("-inf"))


def logprobs_of(raw: torch.Tensor, token_ids: list[int], want: list[int | None]) -> list[TokenLogprob | None]:
    lp = torch.log_softmax(raw, dim=-1)  # (S, vocab)
    ids = torch.tensor(token_ids, device=raw.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1)  # (S,)
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
    top_n = max(w or 0 for w in want)
    top_vals, top_ids = lp.topk(top_n, dim=-1) if top_n else (None, None)
    out: list[TokenLogprob | None] = []
    for i, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        top = {}
        if w and top_ids is not None and top_vals is not None:
            top = dict(zip(top_ids[i, :w].tolist(), top_vals[i, :w].tolist()))
        out.append(TokenLogprob(token_ids[i], float(chosen[i]), int(ranks[i]), top))
    return out
