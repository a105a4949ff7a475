"""A decode step's reservation for a batch that runs again and again: `DecodeLanes` keeps what a
step reads of each sequence in arrays, and `reserve_step` grows the whole batch by one position in a
few array operations, deciding write-in-place or copy by `BlockPool.must_copy_all`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from radixinfer.cache.sequence import ReservePlan, SeqKV

if TYPE_CHECKING:
    from radixinfer.cache.kv_manager import KVCacheManager

_NO_ROWS = np.zeros(0, dtype=np.int64)


class DecodeLanes:
    """The sequences of a decode batch that runs again and again, with what a decode step reads of
    each kept in arrays: its length (``num_kv``) and its boundary block (the table's last entry), so
    `reserve_step` serves the whole batch in a few array operations instead of a pass over the
    sequences.

    The arrays stay true only while `reserve_step` is the one thing that grows or remaps these
    sequences: the engine keeps one while it decodes the same requests in the same order, and builds
    a new one otherwise."""

    def __init__(self, seqs: list[SeqKV]) -> None:
        self.seqs = seqs
        # list comprehensions: a generator costs a Python call per sequence
        self.num_kv = np.array([seq.num_kv for seq in seqs], dtype=np.int64)
        self.last_block = np.array([seq.table[-1] for seq in seqs], dtype=np.int64)


def reserve_step(cache: KVCacheManager, lanes: DecodeLanes) -> ReservePlan | None:
    """``cache.reserve(lanes.seqs)`` (one more position each, all or nothing), with the same plan.

    Served in array operations: a row whose position starts a block (it takes a fresh block), and a
    row whose boundary block no other row of the batch holds and which `BlockPool.must_copy_all`
    lets write in place (it holds the block alone, or claims the slot). Nothing else in the batch
    touches such a block, so the batch's order does not matter for it. The other rows go through
    `reserve`, in batch order: those that copy, and those sharing their boundary block with another
    row (there the order decides: a claim makes the next holder at the same offset copy, a copy
    leaves one holder fewer). They never touch a block of the array rows, so serving them first is
    serving the batch in order.

    Performance: in the steady state (no boundary block shared) this is a dozen numpy operations
    and one pass appending fresh blocks to the tables that cross a block boundary."""
    bs, pool, seqs = cache.block_size, cache.pool, lanes.seqs
    last, offset = lanes.last_block, lanes.num_kv % bs
    fresh = offset == 0
    # (`ndarray.nonzero` of these 1-D masks: `np.flatnonzero` wraps it in ~8 Python calls)
    fresh_rows = fresh.nonzero()[0]
    # A block held alone is never copied (the rule's second term): only shared ones are asked.
    shared = (~fresh & (pool.refcount_view[last] > 1)).nonzero()[0]
    in_order, claims = _NO_ROWS, _NO_ROWS
    if shared.size:
        blocks = last[shared]
        ordered = pool.must_copy_all(blocks, offset[shared]) | _repeated(blocks)
        in_order, claims = shared[ordered], shared[~ordered]
    in_order_seqs = [seqs[i] for i in in_order.tolist()]
    most = len(fresh_rows) + len(in_order_seqs)  # one block each at most (a copy or a fresh block)
    if pool.num_free < most and not cache.ensure_free(
        len(fresh_rows) + cache.blocks_needed(in_order_seqs)
    ):
        return None
    copies: list[tuple[int, int]] = []
    changed = fresh_rows
    if in_order_seqs:  # cannot fail now: the blocks are free
        plan = cache.reserve(in_order_seqs)
        copies = plan.copies
        changed = np.union1d(fresh_rows, in_order[plan.changed])
        last[in_order] = [seq.table[-1] for seq in in_order_seqs]
    if claims.size:
        cache.note_in_place_writes(last[claims].tolist(), offset[claims].tolist())
    if len(fresh_rows):
        new_blocks = pool.allocate(len(fresh_rows))
        for i, block in zip(fresh_rows.tolist(), new_blocks):
            seqs[i].table.append(block)
        last[fresh_rows] = new_blocks
    slots = last * bs + offset
    if in_order_seqs:
        slots[in_order] = plan.slots
        in_place = np.ones(len(seqs), dtype=bool)
        in_place[in_order] = False
        pool.fill_view[last[in_place]] = offset[in_place] + 1
        grown: Sequence[SeqKV] = list(itertools.compress(seqs, in_place.tolist()))
    else:
        pool.fill_view[last] = offset + 1
        grown = seqs
    for seq in grown:
        seq.num_kv += 1
    lanes.num_kv += 1
    return ReservePlan(slots, copies, changed.tolist())


def _repeated(values: np.ndarray) -> np.ndarray:
    """Whether each value occurs more than once in ``values``, as a bool array."""
    if values.size < 2:
        return np.zeros(values.size, dtype=bool)
    order = np.argsort(values, kind="stable")
    same = values[order[1:]] == values[order[:-1]]
    repeated = np.zeros(values.size, dtype=bool)
    repeated[order[1:][same]] = True
    repeated[order[:-1][same]] = True
    return repeated
