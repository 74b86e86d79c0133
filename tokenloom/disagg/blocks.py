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

import numpy as np
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
    chain: list[tuple[int, int | None, tuple[int, ...], int]] = []  # (hash, parent hash, tokens, block id)
    parent_hash: int | None = None
    parent = NO_PARENT
    for i in range(len(token_ids) // bs):
        tokens = tuple(token_ids[i * bs : (i + 1) * bs])
        h = kv.hash_fn(parent_hash, tokens)
        b = kv.pool.lookup(h, tokens, parent)
        if b is None:
            break
        chain.append((h, parent_hash, tokens, b))
        parent_hash, parent = h, b
    payloads = read_blocks(engine.runner.kv_caches, [b for *_, b in chain])
    return [BlockRecord(h, ph, tokens, payload) for (h, ph, tokens, _), payload in zip(chain, payloads)]


def import_prefix(engine: LLMEngine, layout: KVLayout, records: list[BlockRecord]) -> tuple[int, int]:
    """Enter `records` (a prefix chain, first block first) into this engine's prefix cache. Returns
    (blocks written, blocks already held). Stops early, keeping what it wrote, when the pool is full."""
    mine = KVLayout.of(engine)
    if layout != mine:
        raise KVTransferError(f"KV layout mismatch: sender {layout}, receiver {mine}")
    if not engine.kv.enable_prefix_caching:
        raise KVTransferError("receiving KV blocks needs prefix caching (drop --no-prefix-caching)")
    # Every payload's size first: the blocks are indexed before their bytes are written (in one pass at
    # the end), so a payload that could not be written must be refused before any block is indexed.
    _check_sizes([r.payload for r in records], mine.block_nbytes)
    pool = engine.kv.pool
    held: list[int] = []  # referenced while we work, so allocating the next block cannot evict them
    fresh: list[tuple[int, bytes]] = []  # (block, payload) of the blocks allocated here
    present = 0
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
                if pool.cache(b, r.block_hash, r.tokens, parent) != b or pool.lookup(r.block_hash, r.tokens, parent) != b:
                    break  # a hash collision left it unindexed (freed below): the chain cannot continue past it
                fresh.append((b, r.payload))
            parent = b
        # Before the blocks are released (and could be found by a request): this thread runs no step
        # in between, so no request reads them before their bytes are in.
        write_blocks(engine.runner.kv_caches, [b for b, _ in fresh], [p for _, p in fresh])
    finally:
        # Unreferenced again: indexed blocks become cached (evictable, tail first), others free.
        pool.free(list(reversed(held)))
    return len(fresh), present


def _check_sizes(payloads: list[bytes], nbytes: int) -> None:
    for p in payloads:
        if len(p) != nbytes:
            raise KVTransferError(f"block payload of {len(p)} bytes does not match the cache layout ({nbytes})")


def _byte_views(caches: list[LayerKVCache]) -> list[torch.Tensor]:
    """Each cache tensor (K, V, scales; layer by layer) as (num_blocks, bytes per block) uint8: a block's
    payload is its row of each, in this order. Views (`view`, not `reshape`: a copy would lose the writes)."""
    return [t.view(torch.uint8).view(t.shape[0], -1) for c in caches for t in c.tensors()]


def read_blocks(caches: list[LayerKVCache], blocks: list[int]) -> list[bytes]:
    """The payloads of `blocks`: one gather per cache tensor for all of them (block by block, a prompt's 8
    blocks x 60 tensors of SmolLM2 were 480 small copies: 2.5 ms to export and 4.3 ms to import a
    128-token prompt on the 2-core Xeon, 1.6 and 1.4 ms this way; benchmarks/kv_handoff.py)."""
    if not blocks:
        return []
    idx = np.asarray(blocks, dtype=np.int64)
    # numpy's row gathers and scatters on the caches' own memory (uint8 views): a row copy each, where
    # torch's index_copy_ took ~40 us per tensor for a prompt's 8 blocks.
    rows = np.concatenate([v.numpy()[idx] for v in _byte_views(caches)], axis=1)  # (len(blocks), block bytes)
    return [rows[i].tobytes() for i in range(len(blocks))]


def write_blocks(caches: list[LayerKVCache], blocks: list[int], payloads: list[bytes]) -> None:
    """Write each payload into its block: one scatter per cache tensor for all of them."""
    if not blocks:
        return
    views = _byte_views(caches)
    sizes = [v.shape[1] for v in views]
    _check_sizes(payloads, sum(sizes))
    src = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(blocks), -1)
    idx = np.asarray(blocks, dtype=np.int64)
    off = 0
    for v, n in zip(views, sizes):
        v.numpy()[idx] = src[:, off : off + n]
        off += n


def read_block(caches: list[LayerKVCache], block: int) -> bytes:
    return read_blocks(caches, [block])[0]
