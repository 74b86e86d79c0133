"""The pool of fixed-size KV blocks: reference counts, a free list, and the prefix cache's index.

Every block is in exactly one of three states:
- used: some sequence references it (ref count > 0);
- cached: nobody references it, but it holds the K/V of a full block of known tokens, indexed by the
  block's chained hash so a later request with the same prefix can take it instead of recomputing;
- free: nobody references it and it holds nothing reusable.
Invariant (`check_invariants`): free + cached + used == total.

`allocate` takes free blocks first and only then evicts cached ones, least recently used first. A cache
entry records the block's own token ids and its parent block (id and generation), so `lookup` confirms a
hit exactly: a hash collision, or a parent whose content has since been replaced, is a miss, never
wrong K/V.

A model whose layers form several KV groups (engine/kv_cache.py: full-attention and sliding-window
layers) draws every group's blocks from this one pool; the same tokens then have one block per group,
so the index is keyed by (group, hash) and a block caches one group's K/V.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from tokenloom.errors import TokenloomError

NO_PARENT = -1


class NoFreeBlocks(TokenloomError):
    """Raised by `allocate` when the pool cannot satisfy a request; callers check `num_free` first."""


@dataclass(frozen=True)
class CacheEntry:
    block_hash: int
    group: int  # the KV group whose layers' K/V the block holds
    tokens: tuple[int, ...]  # the block_size token ids whose K/V the block holds
    parent: int  # block id of the previous block of the prefix, NO_PARENT for the first
    parent_generation: int  # the parent's generation when this entry was made


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, LRU first
        self._entries: list[CacheEntry | None] = [None] * num_blocks
        self._by_hash: dict[tuple[int, int], int] = {}  # (group, block hash) -> block id
        # Bumped whenever a block's cached content is dropped: children recorded against an older
        # generation of their parent no longer match.
        self._generation = [0] * num_blocks
        self.num_evictions = 0

    # -- counts -----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones plus cached ones it may evict."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold reusable K/V."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    # -- references -------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._drop_entry(b)
                self.num_evictions += 1
            self.ref_counts[b] = 1
            # New content: cache entries of children made against the block's old content (even
            # an unindexed old content, after a hash collision) must no longer match.
            self._generation[b] += 1
            ids.append(b)
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Take one more reference to each block: used blocks (sharing) or cached ones (a prefix hit)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"block {b} is free; it cannot be shared")
                del self._evictable[b]
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. A block nobody references becomes cached if it has an
        entry (most recently used end of the eviction order), else free."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self._entries[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # -- the prefix cache index -------------------------------------------------------------------

    def cache(self, block: int, block_hash: int, tokens: tuple[int, ...], parent: int, group: int = 0) -> int:
        """Record that used block `block` holds `tokens` after `parent`. Returns the block that now
        stands for this content: `block`, or an existing block with exactly the same content and
        chain (the caller should switch to it). With a colliding hash of other content, `block` stays
        unindexed and is returned."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not in use; only computed blocks can be cached")
        existing = self.lookup(block_hash, tokens, parent, group)
        if existing is not None:
            return existing
        if (group, block_hash) in self._by_hash or self._entries[block] is not None:
            return block  # a collision with other content (or already indexed): leave it be
        gen = self._generation[parent] if parent != NO_PARENT else 0
        self._entries[block] = CacheEntry(block_hash, group, tokens, parent, gen)
        self._by_hash[(group, block_hash)] = block
        return block

    def lookup(self, block_hash: int, tokens: tuple[int, ...], parent: int, group: int = 0) -> int | None:
        """The cached block of KV group `group` holding `tokens` right after `parent`, or None. Confirmed
        against the stored tokens and parent, so a hash collision is a miss."""
        b = self._by_hash.get((group, block_hash))
        if b is None:
            return None
        e = self._entries[b]
        if e is None or e.tokens != tokens or e.parent != parent:
            return None
        if parent != NO_PARENT and e.parent_generation != self._generation[parent]:
            return None
        return b

    def clear_cache(self) -> int:
        """Forget every unreferenced cached block (they become free); returns how many."""
        n = len(self._evictable)
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._drop_entry(b)
            self._free.append(b)
        return n

    def _drop_entry(self, b: int) -> None:
        e = self._entries[b]
        if e is not None:
            if self._by_hash.get((e.group, e.block_hash)) == b:
                del self._by_hash[(e.group, e.block_hash)]
            self._entries[b] = None
        self._generation[b] += 1

    def check_invariants(self) -> None:
        free, cached = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        zero = {b for b, c in enumerate(self.ref_counts) if c == 0}
        if zero != free | cached or free & cached:
            raise AssertionError("unreferenced blocks != free + cached")
        if any(c < 0 for c in self.ref_counts):
            raise AssertionError("negative reference count")
        used = self.num_blocks - len(zero)
        if len(free) + len(cached) + used != self.num_blocks:
            raise AssertionError("free + cached + used != total")
        if any(self._entries[b] is None for b in cached):
            raise AssertionError("a cached block has no entry")
        if any(self._entries[b] is not None for b in free):
            raise AssertionError("a free block still has a cache entry")
        for (g, h), b in self._by_hash.items():
            e = self._entries[b]
            if e is None or e.block_hash != h or e.group != g:
                raise AssertionError(f"hash index points at block {b}, which does not hold that hash")
