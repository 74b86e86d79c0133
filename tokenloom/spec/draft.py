"""Draft-model proposals: k tokens drafted autoregressively by a small model that shares the target's
tokenizer (`--speculative draft --draft-model PATH`), or by the target's own first K layers with its
final norm and LM head (`--speculative self --draft-layers K`).

Both run through the target's ModelRunner on the target's block tables, so a draft token's K/V lands
in the slot its verified twin will occupy:
- a separate draft model keeps its own KV tensors (same block ids). It catches up on the tokens it has
  not seen yet (the prompt, on the first proposal) in its first forward of each round, and after
  verification `spec.draft_num_computed` falls back to what the target accepted;
- the self-draft reads and writes the target's own cache for its first K layers: the target computes
  those layers' K/V for every token anyway (and rewrites the draft positions when it verifies).
Greedy requests draft with argmax; sampled ones draw from the draft's distribution under the request's
temperature/top-k/top-p/min-p and keep it (q) for rejection sampling.
"""

from __future__ import annotations

import torch

from tokenloom.engine.runner import ModelRunner, StepInput, build_step
from tokenloom.engine.sampler import Sampler
from tokenloom.engine.sequence import Sequence
from tokenloom.models.llama import KVCache, LlamaForCausalLM


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, model: LlamaForCausalLM, kv_caches: list[KVCache], sampler: Sampler,
                 shares_target_cache: bool) -> None:
        self.runner = runner
        self.model = model
        self.kv_caches = kv_caches
        self.sampler = sampler
        self.shares_target_cache = shares_target_cache

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Draft ks[i] tokens for seqs[i] (each decoding: num_tokens == num_computed_tokens + 1, with
        slots allocated for num_tokens + ks[i] positions); sets seq.spec's token_ids / draft_probs."""
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        for j in range(max(ks, default=0)):
            active = [i for i in active if ks[i] > j]
            if not active:
                break
            entries = []
            for i in active:
                s = seqs[i]
                if j == 0:  # catch up to (and including) the last known token
                    start = s.num_computed_tokens if self.shares_target_cache else min(
                        s.spec.draft_num_computed, s.num_computed_tokens)
                    entries.append(StepInput(s.token_ids[start:], start, s.block_ids, 1, self._groups(s)))
                else:
                    entries.append(StepInput([drafts[i][-1]], s.num_tokens - 1 + j, s.block_ids, 1, self._groups(s)))
            input_ids, positions, meta, _, token_idx = build_step(entries, self.runner.block_size, self.runner.device)
            logits = self.runner.forward(self.model, self.kv_caches, input_ids, positions, meta, token_idx)
            if logits is None:
                raise RuntimeError("draft forward returned no logits")  # every entry asks for one row
            self._pick(logits, [seqs[i] for i in active], [drafts[i] for i in active], [probs[i] for i in active])
        for s, k, d, q in zip(seqs, ks, drafts, probs):
            if k <= 0:
                continue
            s.spec.token_ids = d
            s.spec.draft_probs = torch.stack(q) if q and not s.params.greedy else None
            # The draft's own cache now holds every position before its last draft token.
            s.spec.draft_num_computed = s.num_tokens - 1 + k

    def _groups(self, s: Sequence) -> tuple[list[int], ...]:
        """The block tables of the target's KV groups after the first, which the self-draft's layers may
        belong to (a draft model of its own keeps every block of the first table: builder.py)."""
        return tuple(s.block_tables[1:]) if self.shares_target_cache else ()

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
              probs: list[list[torch.Tensor]]) -> None:
        greedy = [s.params.greedy for s in seqs]
        picks = logits.argmax(dim=-1).tolist()
        sampled = [r for r, g in enumerate(greedy) if not g]
        if sampled:
            q = Sampler.probs([seqs[r] for r in sampled], logits[sampled])  # (len(sampled), vocab)
            tokens = self.sampler.draw(q, [seqs[r] for r in sampled])
            for row, (r, t) in enumerate(zip(sampled, tokens)):
                picks[r] = t
                probs[r].append(q[row])
        for d, t in zip(drafts, picks):
            d.append(t)
