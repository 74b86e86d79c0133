"""Maps sequences to KV blocks: grows a sequence's block table as its tokens are scheduled, frees it at
the end, and (with prefix caching) shares full blocks between requests with the same prefix.

A full block is named by a chained hash, hash(parent block's hash, the block's token ids), so equal
hashes mean equal prefixes up to and including that block (the pool confirms every hit against the
stored tokens). A new sequence starts computing at its first uncached token; at least its last token is
always computed, because its logits are needed to sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenloom.engine.block_pool import NO_PARENT, BlockPool
from tokenloom.engine.sequence import Sequence

HashFn = Callable[[int | None, tuple[int, ...]], int]


_ROOT = 0x746F6B656E6C6F6F  # the first block's "parent": an int, never None (see below)


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is deterministic (no per-process salt), 64 bits, so two worker
    # processes agree on it (disaggregated prefill/decode sends blocks under these hashes). hash(None)
    # is not: before Python 3.12 it derives from None's address, hence the integer root. Hits are
    # verified against the tokens anyway, so a collision costs a recomputation, not correctness.
    return hash((_ROOT if parent_hash is None else parent_hash, tokens))


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens whose K/V came from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash_block) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.stats = PrefixCacheStats()

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold K/V for `num_new_tokens` more tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    # -- admission ----------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq`'s tokens (full blocks only, leaving at
        least one token to compute). Changes nothing; pass the result to `allocate_slots`."""
        if not self.enable_prefix_caching or seq.block_ids:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, limit)
        hits: list[int] = []
        parent = NO_PARENT
        for i in range(limit):
            b = self.pool.lookup(hashes[i], self._tokens(seq, i), parent)
            if b is None:
                break
            hits.append(b)
            parent = b
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Grow `seq`'s block table for `num_new_tokens`; False (nothing changed) if the pool is short.

        `cached` (admission only, from `find_cached_prefix`): blocks the sequence takes instead of
        computing; it then starts at len(cached) * block_size and `num_new_tokens` count from there."""
        if cached is None:
            need = self.blocks_needed(seq, num_new_tokens)
            if need > self.pool.num_free:
                return False
            if need:
                seq.block_ids.extend(self.pool.allocate(need))
            return True
        if seq.block_ids or seq.num_computed_tokens:
            raise ValueError(f"{seq.seq_id}: cached blocks can only be taken by a sequence that holds none")
        start = len(cached) * self.block_size
        need = -(-(start + num_new_tokens) // self.block_size) - len(cached)
        # Taking a cached block that nobody references removes it from what `allocate` may evict.
        reclaimed = sum(1 for b in cached if self.pool.is_evictable(b))
        if need > self.pool.num_free - reclaimed:
            return False
        self.pool.incref(cached)
        seq.block_ids = list(cached) + self.pool.allocate(need)
        seq.num_computed_tokens = start
        seq.num_cached_blocks = len(cached)
        if seq.num_cached_tokens is None:  # the first admission; a preempted one's return is not a query
            seq.num_cached_tokens = start
            if self.enable_prefix_caching:
                self.stats.queries += seq.num_tokens
                self.stats.hits += start
        return True

    # -- after a step -------------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Index the blocks `seq` has filled since the last call (their K/V is now written). A block
        whose content is already cached elsewhere is swapped for that one and returned to the pool."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            parent = seq.block_ids[i - 1] if i else NO_PARENT
            mine = seq.block_ids[i]
            canonical = self.pool.cache(mine, hashes[i], self._tokens(seq, i), parent)
            if canonical != mine:  # same K/V already cached: share it, free our copy
                self.pool.incref([canonical])
                self.pool.free([mine])
                seq.block_ids[i] = canonical
        seq.num_cached_blocks = full

    def trim(self, seq: Sequence) -> None:
        """Return blocks past the ones `seq`'s tokens need (slots of rejected draft tokens). They lie
        beyond its computed tokens, so they are its own and were never indexed in the cache."""
        keep = -(-seq.num_tokens // self.block_size)
        if len(seq.block_ids) > keep:
            self.pool.free(list(reversed(seq.block_ids[keep:])))
            del seq.block_ids[keep:]

    def free(self, seq: Sequence) -> None:
        # Free in reverse so a sequence's tail blocks are evicted first: its head is the part most
        # likely to be shared by a later request.
        self.pool.free(list(reversed(seq.block_ids)))
        seq.block_ids = []
        seq.num_cached_blocks = 0

    def reset_prefix_cache(self) -> int:
        return self.pool.clear_cache()

    @property
    def usage(self) -> float:
        return self.pool.usage

    # -- hashing ------------------------------------------------------------------------------

    def _tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _block_hashes(self, seq: Sequence, n: int) -> list[int]:
        """The chained hashes of `seq`'s first `n` full blocks, memoized on the sequence (its tokens
        only ever grow; a rollback trims `seq.block_hashes` itself)."""
        hashes = seq.block_hashes
        while len(hashes) < n:
            i = len(hashes)
            hashes.append(self.hash_fn(hashes[i - 1] if i else None, self._tokens(seq, i)))
        return hashes
