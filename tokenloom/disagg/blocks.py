"""Reading a prompt's full KV blocks out of an engine's cache and writing received ones into another's.

Both run on the engine's loop thread (`AsyncLLMEngine.call`), between steps, so no step reads or evicts
a block half-way through.

A block travels as its position in the prefix chain (the chained hash of its tokens and its parent's
hash, as the prefix cache names blocks) plus its bytes: for each layer in order, the block's slice of
each cache tensor (K, V, and with a per-token INT8 cache the K and V scales), C order. Received blocks
enter the decode worker's prefix-cache index as cached, unreferenced blocks; the request that follows
finds them at admission and computes only the rest of its prompt.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.config import KVCacheFormat
from tokenloom.engine.block_pool import NO_PARENT
from tokenloom.engine.engine import LLMEngine
from tokenloom.engine.kv_cache import KVCacheSpec
from tokenloom.engine.kv_calibration import scales_digest
from tokenloom.errors import ConfigError, TokenloomError


class KVTransferError(TokenloomError):
    """A transfer that cannot be made or must not be accepted (layout mismatch, corrupt bytes, ...)."""


@dataclass(frozen=True)
class KVLayout:
    """What must agree between sender and receiver for a block's bytes to mean the same thing."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_dtype: str  # "bfloat16", "float32", "int8", ...
    # INT8: "token" (scales travel with each block) or "head:<digest of the calibrated per-head scales>"
    # (codes only: both sides must read them with the same scales); "" for a model-dtype cache.
    kv_scales: str = ""

    @classmethod
    def of(cls, engine: LLMEngine) -> "KVLayout":
        caches = engine.runner.kv_caches
        num_groups = 1 + max(c.group for c in caches)
        if num_groups > 1:
            # A block id then holds one group's K/V for a few layers, and a prefix needs every group's
            # blocks: the transfer format carries one block for the whole layer stack.
            raise ConfigError(
                f"disaggregated prefill/decode cannot transfer the KV cache of {engine.model_name}: its "
                f"sliding-window and full-attention layers keep separate block tables ({num_groups} KV groups, "
                "so windowed layers can release old blocks); serve it with --role both")
        k, fmt = caches[0].k, caches[0].format
        scales = ""
        if fmt.per_head_scales:
            scales = f"head:{scales_digest(caches)}"
        elif fmt.per_token_scales:
            scales = "token"
        return cls(engine.model_name, len(caches), k.shape[2], k.shape[3], k.shape[1],
                   str(k.dtype).removeprefix("torch."), scales)

    @property
    def format(self) -> KVCacheFormat:
        if self.kv_scales == "token":
            return KVCacheFormat.INT8_PER_TOKEN
        if self.kv_scales.startswith("head:"):
            return KVCacheFormat.INT8_PER_HEAD
        return KVCacheFormat.MODEL_DTYPE

    @property
    def spec(self) -> KVCacheSpec:
        """The cache this layout describes. An INT8 layout leaves out the model's dtype (any reads the same
        codes): its spec's dtype is int8 then, which no byte count depends on."""
        dtype = getattr(torch, self.cache_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KVTransferError(f"unknown KV cache dtype {self.cache_dtype!r}")
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, dtype, self.format)

    @property
    def block_nbytes(self) -> int:
        return self.spec.bytes_per_block

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class BlockRecord:
    block_hash: int
    parent_hash: int | None  # None for the first block of a prompt
    tokens: tuple[int, ...]
    payload: bytes


def export_prefix(engine: LLMEngine, token_ids: list[int]) -> list[BlockRecord]:
    """The longest run of `token_ids`' full blocks that this engine holds in its prefix cache, from the
    first block on (call it after the prompt has been computed)."""
    kv = engine.kv
    if not kv.enable_prefix_caching:
        raise KVTransferError("exporting KV blocks needs prefix caching (drop --no-prefix-caching)")
    bs = kv.block_size
    records: list[BlockRecord] = []
    parent_hash: int | None = None
    parent = NO_PARENT
    for i in range(len(token_ids) // bs):
        tokens = tuple(token_ids[i * bs : (i + 1) * bs])
        h = kv.hash_fn(parent_hash, tokens)
        b = kv.pool.lookup(h, tokens, parent)
        if b is None:
            break
        records.append(BlockRecord(h, parent_hash, tokens, read_block(engine.runner.kv_caches, b)))
        parent_hash, parent = h, b
    return records


def import_prefix(engine: LLMEngine, layout: KVLayout, records: list[BlockRecord]) -> tuple[int, int]:
    """Enter `records` (a prefix chain, first block first) into this engine's prefix cache. Returns
    (blocks written, blocks already held). Stops early, keeping what it wrote, when the pool is full."""
    mine = KVLayout.of(engine)
    if layout != mine:
        raise KVTransferError(f"KV layout mismatch: sender {layout}, receiver {mine}")
    if not engine.kv.enable_prefix_caching:
        raise KVTransferError("receiving KV blocks needs prefix caching (drop --no-prefix-caching)")
    pool = engine.kv.pool
    held: list[int] = []  # referenced while we work, so allocating the next block cannot evict them
    written = present = 0
    parent = NO_PARENT
    try:
        for r in records:
            b = pool.lookup(r.block_hash, r.tokens, parent)
            if b is not None:
                pool.incref([b])
                held.append(b)
                present += 1
            else:
                if pool.num_free == 0:
                    break
                b = pool.allocate(1)[0]
                held.append(b)
                write_block(engine.runner.kv_caches, b, r.payload)
                if pool.cache(b, r.block_hash, r.tokens, parent) != b or pool.lookup(r.block_hash, r.tokens, parent) != b:
                    break  # a hash collision left it unindexed: the chain cannot continue past it
                written += 1
            parent = b
    finally:
        # Unreferenced again: indexed blocks become cached (evictable, tail first), others free.
        pool.free(list(reversed(held)))
    return written, present


def read_block(caches: list[LayerKVCache], block: int) -> bytes:
    parts = [t[block].contiguous().view(torch.uint8).reshape(-1) for c in caches for t in c.tensors()]
    return torch.cat(parts).numpy().tobytes()


def write_block(caches: list[LayerKVCache], block: int, payload: bytes) -> None:
    src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    off = 0
    for c in caches:
        for t in c.tensors():
            dst = t[block].view(torch.uint8)  # (block_size, Hkv, D * itemsize) or (block_size, Hkv * 2)
            n = dst.numel()
            if off + n > src.numel():
                raise KVTransferError(f"block payload of {src.numel()} bytes is too short for the cache layout")
            dst.copy_(src[off : off + n].view(dst.shape))
            off += n
    if off != src.numel():
        raise KVTransferError(f"block payload of {src.numel()} bytes does not match the cache layout ({off})")
