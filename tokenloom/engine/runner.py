"""ModelRunner: turns a scheduled batch into flat model inputs, runs the forward pass, returns logits.

All sequences' new tokens are concatenated into one flat batch (T tokens). For each token the runner
computes its position and its KV-cache slot; for each sequence, its block table and context length.
Only sequences whose computed tokens reach the end of what they know get a logits row (a prefill chunk
that stops mid-prompt samples nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tokenloom.attention.base import AttentionBackend, AttentionMetadata
from tokenloom.engine.scheduler import ScheduledBatch
from tokenloom.models.llama import KVCache, LlamaForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Returns input_ids (T,), positions (T,), metadata, sampled batch rows, and their flat token index."""
        input_ids: list[int] = []
        positions: list[int] = []
        seq_index: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_tokens: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seq_index.extend([i] * n)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                sample_rows.append(i)
                sample_tokens.append(query_start_loc[-1] - 1)
        max_blocks = max(len(s.block_ids) for s in batch.seqs)
        tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in batch.seqs]
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long)
        block_tables = torch.tensor(tables, dtype=torch.long)  # (S, max_blocks)
        owner = torch.tensor(seq_index, dtype=torch.long)
        slots = block_tables[owner, pos // self.block_size] * self.block_size + pos % self.block_size
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables.to(dev),
            slot_mapping=slots.to(dev),
            block_size=self.block_size,
        )
        return torch.tensor(input_ids, dtype=torch.long, device=dev), pos.to(dev), meta, sample_rows, sample_tokens

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """Run one step. Returns the batch rows that sample and their (rows, vocab) float32 logits."""
        input_ids, positions, meta, rows, token_idx = self.prepare(batch)
        meta.plan = self.backend.plan(meta, self.device, self.model.config.sliding_window)
        # On CPU, oneDNN wins every matmul with 2+ rows, but a single-row matmul (one decoding
        # sequence) streams weights ~1.7x faster through ATen's own GEMV kernel.
        with _onednn(self.device.type != "cpu" or input_ids.numel() > 1):
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # (T, hidden)
            if not rows:
                return rows, None
            idx = torch.tensor(token_idx, device=self.device)
            return rows, self.model.compute_logits(hidden[idx])


@contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    """Switch oneDNN matmuls on/off for one step (only the enable bit: no other backend flag is touched)."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(enabled)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)
