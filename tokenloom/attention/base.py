"""The attention backend interface: paged K/V written by slot, read through block tables.

The per-layer cache (model dtype or INT8) and its layout are in `paged_kv.LayerKVCache`; the backends
by name (--attention-backend) in `registry.py`.

A model whose windowed layers release old blocks has several KV groups (engine/kv_cache.py), each with its
own block tables and slot mapping; a backend reads the metadata of the layer's group
(`meta.for_group(kv.group)`), so model code passes the same arguments either way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
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
    plan: Any = None  # backend-specific precomputation for the model's default window; see AttentionBackend.plan
    # Plans by sliding window (None: full attention), for models whose layers differ in window (Gemma 2/3):
    # each window's masks are built once per step and shared by the layers with that window.
    plans: dict[int | None, Any] = field(default_factory=dict)
    # KV groups 1.. (group 0 is this object): the same sequences and tokens through each group's own block
    # tables (released entries point at block 0, outside every window) and slot mapping.
    group_metas: list["AttentionMetadata"] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata of KV group `group` (LayerKVCache.group)."""
        if group == 0:
            return self
        if group > len(self.group_metas):
            raise RuntimeError(f"a layer of KV group {group} ran on a step built with "
                               f"{1 + len(self.group_metas)} group(s) of block tables")
        return self.group_metas[group - 1]

    def plan_for(self, backend: "AttentionBackend", device: torch.device, sliding_window: int | None) -> Any:
        """The step's plan for layers with `sliding_window`, built on first use."""
        plan = self.plans.get(sliding_window)
        if plan is None:
            plan = self.plans[sliding_window] = backend.plan(self, device, sliding_window)
        return plan


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
        softcap: float | None = None,
    ) -> torch.Tensor:  # (T, Hq, D)
        """Write k/v into the cache at meta.slot_mapping, then attend over what the cache holds.

        `softcap` (Gemma 2's attn_logit_softcapping; None: off): the scaled scores s become
        softcap * tanh(s / softcap) before the mask and softmax, as transformers' Gemma2 eager attention."""
