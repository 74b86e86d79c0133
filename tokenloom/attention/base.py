"""The attention backend interface: paged K/V written by slot, read through block tables.

The per-layer cache (model dtype or INT8) and its layout are in `paged_kv.LayerKVCache`; the backends
by name (--attention-backend) in `registry.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.attention.paged_kv import LayerKVCache


@dataclass
class AttentionMetadata:
    """One step's flat batch: sequence i owns new tokens [query_start_loc[i], query_start_loc[i+1])."""

    query_start_loc: list[int]  # (S+1,)
    seq_lens: list[int]  # (S,) context length after this step: computed + new tokens
    block_tables: torch.Tensor  # (S, max_blocks) int64, rows padded with 0 past the sequence's blocks
    slot_mapping: torch.Tensor  # (T,) int64 flat cache slot of each new token
    block_size: int
    plan: Any = None  # backend-specific precomputation shared by all layers; see AttentionBackend.plan

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


class AttentionBackend(ABC):
    """Computes attention of the new tokens over their whole context, reading K/V from the paged cache."""

    name: str = "abstract"

    def plan(self, meta: AttentionMetadata, device: torch.device, sliding_window: int | None) -> Any:
        """Per-step precomputation (masks, gather indices), done once and reused by every layer."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D), RoPE applied
        k: torch.Tensor,  # (T, Hkv, D), RoPE applied
        v: torch.Tensor,  # (T, Hkv, D)
        kv: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # (T, Hq, D)
        """Write k/v into the cache at meta.slot_mapping, then attend over what the cache holds."""
