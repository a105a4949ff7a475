"""The planning of a `KVCacheManager.reserve`: which slots each sequence of a batch writes, which
fresh blocks it takes and which boundary blocks it copies first (copy-on-write, by
`BlockPool.must_copy`; `radixinfer.cache.kv_manager` draws the boundary block). A dry run of the
same planning counts the fresh blocks without taking them, so the capacity check and the
reservation never disagree."""

from __future__ import annotations

from collections.abc import Sequence

from radixinfer.cache.block_pool import BlockPool
from radixinfer.cache.sequence import ReservePlan, SeqKV


def plan_growth(
    pool: BlockPool,
    written_fill: dict[int, int],
    seqs: Sequence[SeqKV],
    new_lens: Sequence[int] | None,
    dry_run: bool,
) -> tuple[ReservePlan | None, int]:
    """`KVCacheManager.reserve`'s planning: serve ``seqs`` in order, each to its new length
    (``new_lens`` None: one more position each, a decode step), and return the plan and the fresh
    blocks taken (copies included). ``written_fill``: the manager's blocks touched since the last
    forward was issued -> slots written before it; the plan adds the blocks it hands out or writes.

    A sequence's decision depends on the ones before it in the batch: one that claims the next slot
    of a shared block makes a later one at the same offset copy it, and one that copies leaves the
    block with one holder fewer. So a ``dry_run`` (no plan, only the count) makes those two changes
    to the pool's counters too, decides each sequence by the same `BlockPool.must_copy`, and puts
    the counters back."""
    bs = pool.block_size
    fill, refcount = pool.fill, pool.refcount
    one_each = new_lens is None  # a decode step: the loop derives each new length, no list built
    slots: list[int] = []
    copies: list[tuple[int, int]] = []
    changed: list[int] = []
    touched: dict[int, tuple[int, int]] = {}  # a dry run's boundary blocks -> (fill, refcount)
    need = 0
    for i, seq in enumerate(seqs):
        start = seq.num_kv
        new_len = start + 1 if one_each else new_lens[i]
        if new_len <= start:
            continue
        table = seq.table
        offset = start % bs
        if dry_run:
            need += -(-new_len // bs) - len(table)
            if offset:
                last = table[-1]
                if last not in touched:
                    touched[last] = (fill[last], refcount[last])
                if pool.must_copy(last, offset):
                    need += 1
                    refcount[last] -= 1  # its reference moves to the copy
                else:
                    fill[last] = min(bs, offset + new_len - start)
            continue
        if offset:
            last = table[-1]
            if pool.must_copy(last, offset):
                copy = pool.fork(last)
                copies.append((last, copy))
                changed.append(i)
                table[-1] = last = copy
                written_fill[copy] = 0  # even its first `offset` slots arrive only with the copy
            elif written_fill.get(last, bs) > offset:
                # Slots from `offset` on are written by this forward (a sole holder may rewrite
                # stale ones).
                written_fill[last] = offset
            end = offset + new_len - start
            if end <= bs:  # the growth stays inside the boundary block (a decode step, 15 in 16)
                fill[last] = end
                base = last * bs
                if end - offset == 1:
                    slots.append(base + offset)
                else:
                    slots.extend(range(base + offset, base + end))
                seq.num_kv = new_len
                continue
            fill[last] = bs
        num_fresh = -(-new_len // bs) - len(table)
        if num_fresh:
            need += num_fresh
            if not changed or changed[-1] != i:
                changed.append(i)
            first_new = len(table)
            fresh = pool.allocate(num_fresh)
            table.extend(fresh)
            for k, b in enumerate(fresh):
                fill[b] = min(bs, new_len - (first_new + k) * bs)
                written_fill[b] = 0
        if new_len - start == 1:
            slots.append(table[start // bs] * bs + offset)
        else:  # one run of consecutive slots per block
            for index in range(start // bs, (new_len - 1) // bs + 1):
                shift = (table[index] - index) * bs  # slot of position p in this block: p + shift
                slots.extend(
                    range(max(start, index * bs) + shift, min(new_len, (index + 1) * bs) + shift)
                )
        seq.num_kv = new_len
    if dry_run:
        for block, (block_fill, holders) in touched.items():
            fill[block], refcount[block] = block_fill, holders
        return None, need
    return ReservePlan(slots, copies, changed), need + len(copies)
