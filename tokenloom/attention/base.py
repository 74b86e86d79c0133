"""The attention backend interface: paged K/V written by slot, read through block tables.

KV cache layout, per layer: k_cache and v_cache of shape (num_blocks, block_size, num_kv_heads, head_dim).
Token t of a sequence lives in block `block_table[t // block_size]` at offset `t % block_size`, i.e. at
flat slot `block * block_size + offset` of the cache viewed as (num_blocks * block_size, heads, dim).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


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


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter the new tokens' K/V (T, Hkv, D) into their cache slots."""
    num_blocks, block_size, heads, dim = k_cache.shape
    k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, (length, Hkv, D), read through its block ids."""
    return cache[block_ids].flatten(0, 1)[:length]


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
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # (T, Hq, D)
        """Write k/v into the cache at meta.slot_mapping, then attend."""


BACKENDS = ("auto", "cpu", "sdpa", "reference")


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: the C++ kernel backend on CPU when it builds, else (and on CUDA) torch SDPA."""
    from tokenloom.attention.cpu import CPUBackend
    from tokenloom.kernels import load_cpu_kernels
    from tokenloom.attention.reference import ReferenceBackend
    from tokenloom.attention.sdpa import SDPABackend
    from tokenloom.errors import ConfigError

    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")
    if name == "reference":
        return ReferenceBackend()
    if name in ("auto", "cpu") and device.type == "cpu":
        kernels = load_cpu_kernels()
        if kernels is not None:
            return CPUBackend(kernels)
        if name == "cpu":
            raise ConfigError("--attention-backend cpu: the C++ kernels could not be built (see the log)")
    return SDPABackend()
