"""KV cache sizing and allocation: how many blocks a memory budget buys, and the per-layer tensors.

Sliding-window layers (Mistral: every layer; Gemma 2/3: 5 of 6; Qwen2 with max_window_layers) never read
a key more than `window` positions behind the query, so the blocks behind every query's reach can go back
to the pool (engine/kv_cache_manager.py releases them). For that the layers form KV groups (`kv_groups`):
layers that share a window share one block table per sequence, and a windowed group's table drops its old
blocks while the full-attention group keeps all of them.

Memory layout, as vLLM v1's hybrid KV cache manager does it: one pool of blocks serves every group. The
cache has S tensor slots (S = the smallest group's layer count; bigger groups split into groups of S
layers), each (num_blocks, block_size, Hkv, D) for K and V; the i-th layer of every group keeps its K/V in
slot i. A block id therefore stands for S layers x block_size tokens and belongs to one group at a time.
One pool rather than a pool per group because what a sequence needs of each group depends on its length:
below the window every group needs the same blocks per token, far above it the windowed groups need a
fixed few. A fixed split would be wrong for one or the other; a shared pool fits both. The price: a group
of fewer than S layers (22 windowed layers over 4-layer groups: the last has 2) leaves slots unused.

Measured with `KVCapacity.blocks_per_seq` (what a sequence of n tokens holds at its peak, a prefill chunk
of 512 tokens included): a Gemma-3-270M-shaped cache (18 layers: 15 windowed at 512, 3 full; 1 KV head of
256, bfloat16, 16-token blocks) holds 18 x 32768 = 589,824 layer-tokens (576 MiB) for one 32k-token
conversation without release, and 3 x 32768 + 15 x 1040 = 113,904 (111.2 MiB) with it: 5.2x the
conversations in the same memory (2 GiB: 3.56 -> 18.4 at max_model_len 32768). A Mistral-7B-shaped one
(32 layers, window 4096, 8 KV heads of 128) goes from 32 x 32768 (4 GiB) to 32 x 4624 layer-tokens
(578 MiB) per 32k-token conversation: 7.1x.

Where blocks are kept anyway: a --speculative draft model keeps its own K/V in the target's first block
table (builder.py: one group, nothing released); a window no shorter than max_model_len never binds.
Several groups cannot travel to a disaggregated decode worker (disagg/blocks.py refuses them) and do not
run on the fused C++ decode stack (engine/fused_decode.py); one windowed group (Mistral) does both.
"""

from __future__ import annotations

import dataclasses
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
class KVGroup:
    """Layers whose K/V one block table per sequence indexes: they share a window, so the same blocks
    fall out of their reach at the same time."""

    window: int | None  # None: full attention, the group keeps every block of a sequence
    layers: tuple[int, ...]  # model layer indices; the i-th keeps its K/V in cache tensor slot i


def kv_groups(cfg: ModelConfig, max_model_len: int, release_windowed: bool = True) -> tuple[KVGroup, ...]:
    """The model's KV groups, full-attention layers first (group 0: what a caller that knows one block
    table, e.g. a draft model, reads). One group of every layer (the plain layout, nothing released) when
    no layer's window is shorter than max_model_len or `release_windowed` is off."""
    n = cfg.num_hidden_layers
    windows = [cfg.layer_window(i) for i in range(n)]
    windows = [w if w is not None and w < max_model_len else None for w in windows]
    if not release_windowed or all(w is None for w in windows):
        return (KVGroup(None, tuple(range(n))),)
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_window.setdefault(w, []).append(i)
    slots = min(len(layers) for layers in by_window.values())
    groups = []
    for w in sorted(by_window, key=lambda w: -1 if w is None else w):
        layers = by_window[w]
        groups.extend(KVGroup(w, tuple(layers[j : j + slots])) for j in range(0, len(layers), slots))
    return tuple(groups)


def num_slots(groups: tuple[KVGroup, ...]) -> int:
    """Cache tensor slots: the layers one block id stands for."""
    return max(len(g.layers) for g in groups)


def window_blocks(window: int, block_size: int, chunk: int) -> int:
    """The most blocks a windowed group holds for one sequence: the `window - 1` keys behind a step's first
    query plus the step's `chunk` new tokens, misaligned by up to a block at either end."""
    return -(-(window - 1 + chunk) // block_size) + 1


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    bytes_total: int
    max_model_len: int
    cache_dtype: str = "bfloat16"  # what each K/V value is stored as
    groups: tuple[KVGroup, ...] = ()  # () = one full-attention group of every layer
    chunk: int = 0  # tokens one step computes for a sequence at most (max_num_batched_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens of K/V the blocks hold for one group's layers."""
        return self.num_blocks * self.block_size

    def blocks_per_seq(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds at most, over all groups."""
        full = -(-num_tokens // self.block_size)
        if not self.groups:
            return full
        return sum(full if g.window is None else min(full, window_blocks(g.window, self.block_size, self.chunk))
                   for g in self.groups)

    @property
    def max_concurrency(self) -> float:
        """How many sequences of `max_model_len` tokens fit at once."""
        return self.num_blocks / self.blocks_per_seq(self.max_model_len)

    def describe(self) -> str:
        concurrency = f"max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency:.2f} sequences"
        if not any(g.window is not None for g in self.groups):
            return (f"KV cache ({self.cache_dtype}): {self.num_blocks} blocks x {self.block_size} tokens = "
                    f"{self.num_tokens} tokens ({self.bytes_total / 2**20:.1f} MiB); {concurrency}")
        kinds: dict[int | None, list[KVGroup]] = {}
        for g in self.groups:
            kinds.setdefault(g.window, []).append(g)
        parts = []
        for w, gs in kinds.items():
            layers = sum(len(g.layers) for g in gs)
            if w is None:
                parts.append(f"{layers} full-attention layers ({len(gs)} groups) keep every block")
            else:
                parts.append(f"{layers} layers of window {w} ({len(gs)} groups) keep at most "
                             f"{window_blocks(w, self.block_size, self.chunk)} blocks per group and sequence")
        plain = -(-self.max_model_len // self.block_size) * len(self.groups)
        return (f"KV cache ({self.cache_dtype}): {self.num_blocks} blocks of {self.block_size} tokens x "
                f"{num_slots(self.groups)} layers ({self.bytes_total / 2**20:.1f} MiB) shared by {len(self.groups)} "
                f"KV groups: {'; '.join(parts)}. A {self.max_model_len}-token sequence holds "
                f"{self.blocks_per_seq(self.max_model_len)} blocks ({plain} without releasing windowed blocks); "
                f"{concurrency}")


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def plan_capacity(spec: KVCacheSpec, budget: str, device: torch.device, max_model_len: int,
                  extra_bytes_per_block: int = 0, groups: tuple[KVGroup, ...] = (), chunk: int = 0) -> KVCapacity:
    """Blocks the budget buys; `extra_bytes_per_block`: a draft model's K/V kept for the same blocks.
    `groups` (from `kv_groups`; () = one group of every layer): a block then holds `num_slots` layers;
    `chunk`: the most tokens a step computes for one sequence (max_num_batched_tokens)."""
    nbytes, fraction = parse_memory(budget)
    free = free_memory_bytes(device)
    nbytes = int(free * fraction) if fraction is not None else int(nbytes or 0)
    if nbytes > free:
        raise ConfigError(
            f"--kv-cache-memory {budget} ({nbytes / 2**30:.2f} GiB) exceeds free memory ({free / 2**30:.2f} GiB)"
        )
    block_spec = dataclasses.replace(spec, num_layers=num_slots(groups)) if groups else spec
    per_block = block_spec.bytes_per_block + extra_bytes_per_block
    num_blocks = nbytes // per_block
    capacity = KVCapacity(int(num_blocks), spec.block_size, int(num_blocks * per_block), max_model_len,
                          spec.cache_dtype_name, groups, chunk)
    need = capacity.blocks_per_seq(max_model_len)
    if num_blocks < need:
        held = (f"{num_blocks * spec.block_size} tokens of KV" if not groups or len(groups) == 1
                else f"{num_blocks} blocks of KV ({need} per sequence)")
        raise ConfigError(
            f"--kv-cache-memory {budget} holds {held}, fewer than one sequence of --max-model-len "
            f"{max_model_len}; raise the budget or lower --max-model-len"
        )
    return capacity


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device,
                      fixed_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                      groups: tuple[KVGroup, ...] = ()) -> list[LayerKVCache]:
    """One LayerKVCache per layer, (num_blocks, block_size, num_kv_heads, head_dim) each for K and V.
    `fixed_scales`: each layer's calibrated (Hkv,) K and V scales, for an INT8 cache with per-head scales.
    With `groups` the layers of different groups share tensor slots (see the module docstring); each
    layer's cache carries its group and, with per-head INT8, its own scales over the shared codes."""
    per_head = spec.format.per_head_scales
    if per_head and (fixed_scales is None or len(fixed_scales) != spec.num_layers):
        raise ConfigError("an INT8 KV cache with per-head scales needs calibrated scales for every layer")
    groups = groups or (KVGroup(None, tuple(range(spec.num_layers))),)
    if sorted(i for g in groups for i in g.layers) != list(range(spec.num_layers)):
        raise ConfigError(f"KV groups {groups} do not cover the model's {spec.num_layers} layers once each")
    slots = []
    for i in range(num_slots(groups)):
        first = fixed_scales[groups[0].layers[i]] if per_head and fixed_scales else None
        slots.append(LayerKVCache.allocate(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                                           spec.dtype, spec.format, device, first))
    caches: list[LayerKVCache | None] = [None] * spec.num_layers
    for g, group in enumerate(groups):
        for i, layer in enumerate(group.layers):
            cache = slots[i]
            if per_head and fixed_scales:
                ks, vs = (s.to(device=device, dtype=SCALE_DTYPE).expand(cache.k.shape[:3]) for s in fixed_scales[layer])
                cache = dataclasses.replace(cache, k_scale=ks, v_scale=vs)
            caches[layer] = dataclasses.replace(cache, group=g)
    return [c for c in caches if c is not None]
