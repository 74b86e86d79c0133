"""ModelRunner: turns a scheduled batch into flat model inputs, runs the forward pass, returns logits.

All sequences' new tokens are concatenated into one flat batch (T tokens). For each token the runner
computes its position and its KV-cache slot; for each sequence, its block table and context length.
Only sequences whose computed tokens reach the end of what they know get logits (a prefill chunk that
stops mid-prompt samples nothing); a sequence verifying k draft tokens gets k + 1 rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tokenloom.attention.base import AttentionBackend, AttentionMetadata
from tokenloom.engine.fused_decode import FusedDecoder
from tokenloom.engine.scheduler import ScheduledBatch
from tokenloom.models.llama import KVCache
from tokenloom.models.loader import CausalLM


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
        fused: FusedDecoder | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.fused = fused  # serves this model's all-decode steps (not the draft's)
        self.block_size = block_size
        self.backend = backend
        self.device = device

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Returns input_ids (T,), positions (T,), metadata, the batch row of each logits row, and the
        flat token index of each logits row."""
        entries = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # What the sequence knows: its tokens, then its draft tokens (if any) to verify.
            start, end, drafts = seq.num_computed_tokens, seq.num_computed_tokens + n, seq.spec.token_ids
            ids = seq.token_ids[start:end]  # copies only this step's tokens
            if drafts and end > seq.num_tokens:
                ids += drafts[: end - seq.num_tokens]
            # A sequence whose step reaches the end of what it knows samples: one logits row, or
            # 1 + k rows when it verifies k draft tokens.
            num_logits = 1 + len(drafts) if end == seq.num_tokens + len(drafts) else 0
            entries.append(StepInput(ids, start, seq.block_ids, num_logits, tuple(seq.block_tables[1:])))
        return build_step(entries, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """Run one step. Returns the batch row of each logits row and the (rows, vocab) float32 logits."""
        input_ids, positions, meta, rows, token_idx = self.prepare(batch)
        return rows, self.forward(self.model, self.kv_caches, input_ids, positions, meta, token_idx)

    def forward(self, model: CausalLM, kv_caches: list[KVCache], input_ids: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata, token_idx: list[int]) -> torch.Tensor | None:
        """One forward over a flat batch; logits of the tokens at `token_idx` (None if there are none).
        `kv_caches` may be fewer than the model's layers: the self-draft runs only the first K."""
        meta.plan = meta.plan_for(self.backend, self.device, model.config.sliding_window)
        # On CPU, oneDNN wins every matmul with 2+ rows, but a single-row matmul (one decoding
        # sequence) streams weights faster through ATen's own GEMV kernel
        # (docs/performance-notes.md#single-row-matmuls-and-onednn).
        with _onednn(self.device.type != "cpu" or input_ids.numel() > 1):
            if (self.fused is not None and model is self.model and kv_caches is self.kv_caches
                    and getattr(meta.plan, "all_decode", False)):
                hidden = self.fused.forward(input_ids, positions, meta)  # the same values, one C++ call
            else:
                hidden = model(input_ids, positions, kv_caches, meta)  # (T, hidden)
            if not token_idx:
                return None
            idx = torch.tensor(token_idx, device=self.device)
            return model.compute_logits(hidden[idx])


@dataclass(frozen=True)
class StepInput:
    """One sequence's part of a flat batch."""

    token_ids: list[int]  # the tokens to compute this step
    start: int  # position of token_ids[0]
    block_ids: list[int]  # the sequence's block table (covers start + len(token_ids) positions)
    num_logits: int  # logits rows wanted for the last tokens (0: none)
    group_block_ids: tuple[list[int], ...] = ()  # its tables of KV groups 1.. (engine/kv_cache.py), if any


def build_step(entries: list[StepInput], block_size: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
    """Flat model inputs for `entries`: input_ids (T,), positions (T,), attention metadata, the entry
    index of each logits row and the flat token index of each logits row."""
    input_ids: list[int] = []
    positions: list[int] = []
    seq_index: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logit_rows: list[int] = []
    logit_tokens: list[int] = []
    for i, e in enumerate(entries):
        n = len(e.token_ids)
        input_ids.extend(e.token_ids)
        positions.extend(range(e.start, e.start + n))
        seq_index.extend([i] * n)
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(e.start + n)
        end = query_start_loc[-1]
        logit_rows.extend([i] * e.num_logits)
        logit_tokens.extend(range(end - e.num_logits, end))
    pos = torch.tensor(positions, dtype=torch.long)
    owner = torch.tensor(seq_index, dtype=torch.long)
    num_groups = 1 + len(entries[0].group_block_ids)
    if any(len(e.group_block_ids) != num_groups - 1 for e in entries):
        raise ValueError("every sequence of a step needs one block table per KV group")
    metas = []
    for g in range(num_groups):
        group_tables = [e.block_ids if g == 0 else e.group_block_ids[g - 1] for e in entries]
        max_blocks = max(len(t) for t in group_tables)
        rows = [t + [0] * (max_blocks - len(t)) for t in group_tables]
        block_tables = torch.tensor(rows, dtype=torch.long)  # (S, max_blocks)
        new_blocks = block_tables[owner, pos // block_size]  # (T,)
        if bool((new_blocks < 0).any()):  # a released entry (NULL_BLOCK) is never written
            raise RuntimeError("a new token's KV slot lies in a released block")
        slots = new_blocks * block_size + pos % block_size
        # Padding and released entries read block 0: outside every query's window, always masked.
        block_tables.clamp_(min=0)
        metas.append(AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables.to(device),
            slot_mapping=slots.to(device),
            block_size=block_size,
        ))
    meta = metas[0]
    meta.group_metas = metas[1:]
    return torch.tensor(input_ids, dtype=torch.long, device=device), pos.to(device), meta, logit_rows, logit_tokens


@contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    """Switch oneDNN matmuls on/off for one step (only the enable bit: no other backend flag is touched)."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(enabled)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)
