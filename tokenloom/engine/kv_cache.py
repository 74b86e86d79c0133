"""KV cache sizing and allocation: how many blocks a memory budget buys, and the per-layer tensors."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from tokenloom.attention.paged_kv import SCALE_DTYPE, LayerKVCache
from tokenloom.config import KVCacheFormat, parse_memory
from tokenloom.errors import ConfigError
from tokenloom.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape and format of a model's KV cache: what sizing (here), allocation and KV transfers
    (disagg/blocks.py `KVLayout.spec`) agree on. The bytes a token and a block take are counted here only."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's dtype: what attention computes in, and what a MODEL_DTYPE cache stores
    format: KVCacheFormat = KVCacheFormat.MODEL_DTYPE

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                  format: KVCacheFormat = KVCacheFormat.MODEL_DTYPE) -> "KVCacheSpec":
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, dtype, format)

    @property
    def cache_dtype(self) -> torch.dtype:
        """What each K/V value is stored as."""
        return torch.int8 if self.format.quantized else self.dtype

    @property
    def cache_dtype_name(self) -> str:
        if self.format.quantized:
            return self.format.value  # "int8, per-head scales" | "int8, per-token scales"
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        # K and V, every layer: head_dim values per head, plus the head's scale when quantized per token
        # (per-head scales are a few bytes per layer, not per token).
        per_head = self.head_dim * self.cache_dtype.itemsize
        if self.format.per_token_scales:
            per_head += SCALE_DTYPE.itemsize
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    bytes_total: int
    max_model_len: int
    cache_dtype: str = "bfloat16"  # what each K/V value is stored as

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many sequences of `max_model_len` tokens fit at once."""
        return self.num_blocks / -(-self.max_model_len // self.block_size)

    def describe(self) -> str:
        return (
            f"KV cache ({self.cache_dtype}): {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_tokens} tokens "
            f"({self.bytes_total / 2**20:.1f} MiB); max concurrency at max_model_len={self.max_model_len}: "
            f"{self.max_concurrency:.2f} sequences"
        )


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def plan_capacity(spec: KVCacheSpec, budget: str, device: torch.device, max_model_len: int,
                  extra_bytes_per_block: int = 0) -> KVCapacity:
    """Blocks the budget buys; `extra_bytes_per_block`: a draft model's K/V kept for the same blocks."""
    nbytes, fraction = parse_memory(budget)
    free = free_memory_bytes(device)
    nbytes = int(free * fraction) if fraction is not None else int(nbytes or 0)
    if nbytes > free:
        raise ConfigError(
            f"--kv-cache-memory {budget} ({nbytes / 2**30:.2f} GiB) exceeds free memory ({free / 2**30:.2f} GiB)"
        )
    per_block = spec.bytes_per_block + extra_bytes_per_block
    num_blocks = nbytes // per_block
    blocks_per_seq = -(-max_model_len // spec.block_size)
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            f"--kv-cache-memory {budget} holds {num_blocks * spec.block_size} tokens of KV, fewer than one "
            f"sequence of --max-model-len {max_model_len}; raise the budget or lower --max-model-len"
        )
    return KVCapacity(int(num_blocks), spec.block_size, int(num_blocks * per_block), max_model_len,
                      spec.cache_dtype_name)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device,
                      fixed_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[LayerKVCache]:
    """One LayerKVCache per layer, (num_blocks, block_size, num_kv_heads, head_dim) each for K and V.
    `fixed_scales`: each layer's calibrated (Hkv,) K and V scales, for an INT8 cache with per-head scales."""
    per_head = spec.format.per_head_scales
    if per_head and (fixed_scales is None or len(fixed_scales) != spec.num_layers):
        raise ConfigError("an INT8 KV cache with per-head scales needs calibrated scales for every layer")
    return [
        LayerKVCache.allocate(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype,
                              spec.format, device, fixed_scales[i] if per_head and fixed_scales else None)
        for i in range(spec.num_layers)
    ]
