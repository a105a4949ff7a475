"""A fixed pool of refcounted KV blocks.

One block id indexes the same page in every layer's K and V tensors, so all bookkeeping here is per block,
never per layer. Besides refcounts the pool keeps, per block, how many of its slots have been written
(``fill``): slots of a block are written in position order, so the written slots are always ``[0, fill)``.
That is what makes copy-on-write decisions O(1) (docs/invariants.md, invariant 2): a holder whose next position in
the block is ``offset`` may write in place iff ``fill == offset`` (nobody wrote there yet: it *claims* the
slot) or it is the block's only holder; otherwise it must copy the block first (`BlockPool.must_copy`, the
one place the rule is written).
"""

from __future__ import annotations

import array
from collections import deque
from collections.abc import Iterable

import numpy as np


class OutOfBlocks(RuntimeError):
    """Raised by `BlockPool.allocate` when fewer blocks are free than asked for; nothing was allocated."""


class BlockPool:
    """Refcounts, fill counters and a free list over ``num_blocks`` block ids.

    Invariants (checked by `check_integrity`): a block is free iff its refcount is 0; the free list holds
    each free block exactly once; a free block has ``fill == 0``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Read and written one block at a time from Python on most paths, and a whole decode batch at a time
        # through numpy views of the same memory (`KVCacheManager.reserve_step`): an array.array indexes from
        # Python nearly as fast as a list, and numpy can view it. (The views pin the arrays' size, which never
        # changes.)
        self.refcount = array.array("i", bytes(4 * num_blocks))
        self.fill = array.array("i", bytes(4 * num_blocks))
        self.refcount_view = np.frombuffer(self.refcount, dtype=np.intc)
        self.fill_view = np.frombuffer(self.fill, dtype=np.intc)
        # A stack: the most recently freed block is handed out first (it is likeliest to be warm in L2).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` fresh blocks (refcount 1, fill 0), all or nothing."""
        free = self._free
        if n > len(free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(free)} of {self.num_blocks} free")
        blocks = self._take(n)
        refcount = self.refcount
        for b in blocks:
            refcount[b] = 1
        return blocks

    def _take(self, n: int) -> list[int]:
        """Remove ``n <= num_free`` blocks from the free list, the order in which the pool hands
        them out: the most recently freed first."""
        if n == 0:
            return []
        free = self._free
        blocks = free[-n:]
        del free[-n:]
        return blocks

    def fork(self, block: int) -> int:
        """Copy-on-write bookkeeping: move one reference from the shared ``block`` (refcount > 1, so it stays
        held) to a fresh block, and return the fresh one (refcount 1, fill 0)."""
        if not self._free:
            raise OutOfBlocks(f"asked for 1 KV block, 0 of {self.num_blocks} free")
        assert self.refcount[block] > 1, f"fork of block {block}, which has no other holder"
        (fresh,) = self._take(1)
        self.refcount[fresh] = 1
        self.refcount[block] -= 1
        return fresh

    def must_copy(self, block: int, offset: int) -> bool:
        """The copy-on-write rule (docs/invariants.md, invariant 2), for a holder of ``block`` whose next
        position falls at ``offset > 0`` inside it: it may write in place iff nobody wrote that slot yet
        (``fill == offset``: it claims the slot) or it holds the block alone; otherwise it must copy the block
        first. `must_copy_all` is the same rule over arrays."""
        return self.fill[block] != offset and self.refcount[block] > 1

    def must_copy_all(self, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """`must_copy` for each ``(blocks[i], offsets[i])``, as a bool array, on the pool as it is now (each
        answer holds for a holder served alone: a claim or a copy by another holder of the same block changes
        the block's fill or holders)."""
        return (self.fill_view[blocks] != offsets) & (self.refcount_view[blocks] > 1)

    def incref(self, blocks: Iterable[int]) -> None:
        refcount = self.refcount
        for b in blocks:
            refcount[b] += 1

    def decref(self, blocks: Iterable[int]) -> int:
        """Drop one reference to each block; returns how many became free."""
        refcount, fill, free = self.refcount, self.fill, self._free
        freed = 0
        for b in blocks:
            r = refcount[b] - 1
            refcount[b] = r
            if r == 0:
                fill[b] = 0
                free.append(b)
                freed += 1
        return freed

    def check_integrity(self, expected_refcounts: dict[int, int] | None = None) -> None:
        """Assert the pool's invariants; with ``expected_refcounts`` (block -> holders, as counted by the
        caller from the tree and live sequences) also assert every refcount equals its holder count."""
        assert len(self._free) == len(set(self._free)), "a block is on the free list twice"
        free = set(self._free)
        for b in range(self.num_blocks):
            r = self.refcount[b]
            assert r >= 0, f"block {b} has negative refcount {r}"
            assert (r == 0) == (b in free), f"block {b}: refcount {r} but on free list: {b in free}"
            if r == 0:
                assert self.fill[b] == 0, f"free block {b} has fill {self.fill[b]}"
            assert 0 <= self.fill[b] <= self.block_size
            if expected_refcounts is not None:
                want = expected_refcounts.get(b, 0)
                assert r == want, f"block {b}: refcount {r}, but {want} holders"


class QueuedBlockPool(BlockPool):
    """A `BlockPool` that hands out the blocks freed longest ago first (its free list is a queue,
    lowest ids first at the start): the host tier's pool. A host block freed by a load queued in
    the same take as a later write-back is then not that write-back's destination unless the pool
    is nearly full, so the two copies need not run in separate batches
    (`radixinfer.cache.host_tier.HostTier.take_transfers`); and blocks freed together (a node's)
    are handed out together, in consecutive runs, each one copy across the bus."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._free = deque(range(num_blocks))  # type: ignore[assignment]

    def _take(self, n: int) -> list[int]:
        take = self._free.popleft
        return [take() for _ in range(n)]
