"""The sequence side of the prefix cache: what the engine drives to give each request its KV blocks.

A live sequence owns a block table (one reference per entry) and, while the prefix cache is on, a lock on
the deepest tree node of its cached path. The lifecycle (docs/request-lifecycle.md)::

    seq = admit(tokens, salt)          match + lock; table = matched blocks (num_kv = match length)
    plan = reserve([seq], [n])         slots for positions num_kv..n-1 (+ copy-on-write of the boundary block)
    publish(seq, tokens[:seq.num_kv])  insert the path, remap duplicates onto the tree's blocks, move the lock
    plan = reserve(seqs)               a decode step: one slot per sequence, batched COWs
    plan = reserve_step(lanes)         the same for a batch that repeats step after step (`DecodeLanes`)
    release(seq)                       unlock, drop every reference
    release(seq, publish=tokens)       a finish or preemption: insert what it computed, then release

The boundary block. A sequence whose next position ``p`` falls inside its last block ``B`` at ``offset =
p % block_size`` may write in place only if nobody wrote that slot yet (``fill[B] == offset``: it claims
it) or it holds ``B`` alone; otherwise it copies ``B`` to a fresh block first (copy-on-write)::

    tree:  [a b c d | e f g .]   B (fill 3)       seq with path "a b c d e f x":
    seq:   [a b c d | e f x .]   B' = copy(B), then write "x" at offset 2 of B'

Copies are returned to the caller, who performs all of a step's copies in one batched launch *before*
the step's K/V writes.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixinfer.cache.block_pool import BlockPool
from radixinfer.cache.radix_tree import (
    InsertResult,
    MatchResult,
    Node,
    RadixTree,
    TokenArray,
    as_token_array,
)


@dataclass(eq=False)
class SeqKV:
    """A live sequence's cache state. ``table[i]`` holds positions ``i*block_size ..``; positions
    ``[0, num_kv)`` have KV stored (or scheduled to be stored by the current step) in the table's slots."""

    salt: Hashable
    table: list[int]
    num_kv: int
    num_cached: int  # prompt tokens found in the cache at admission
    payload: (
        Any  # the cached final hidden state when the whole prompt was an exact repeat, else None
    )
    node: Node | None  # the locked tree node, or None
    released: bool = False
    # The admission walk: the first `publish` reuses it while it stands for the published path's walk.
    match: TreeWalk | None = None


@dataclass(frozen=True)
class TreeWalk:
    """A walk of a query of ``query_len`` tokens from the root, taken at tree ``version``, kept so a later step
    need not walk again: the policy's peek for the admission, the admission match for the first publish.

    While the tree is unchanged it is also the walk of a path that starts with the query's first
    ``min(n, query_len)`` tokens, for a path of ``n`` tokens where either ``n <= query_len`` (the walk of a
    prefix stops where the query's did, or earlier) or the query's walk stopped short of its end (the tree
    diverges there, so tokens past the query cannot extend it). A path that goes on past a query the tree
    matched to its end may go on matching: it must be walked."""

    result: MatchResult
    query_len: int
    version: int

    def walk_of(self, n: int, version: int) -> MatchResult | None:
        """The walk of the sequence's first ``n`` tokens at tree ``version``, when this one stands for it."""
        length = self.result.length
        if (
            version == self.version
            and length <= n
            and (n <= self.query_len or length < self.query_len)
        ):
            return self.result
        return None


@dataclass(frozen=True)
class ReservePlan:
    """Slots to write, in order (per sequence, its positions ``old num_kv .. new num_kv - 1``), the block
    copies ``(src, dst)`` to perform before those writes, and which sequences' block tables changed (their
    indices in the call, ascending): they took a fresh block or copied their boundary block. `reserve_step`
    gives the slots as an int64 array."""

    slots: list[int] | np.ndarray
    copies: list[tuple[int, int]]
    changed: list[int]


class DecodeLanes:
    """The sequences of a decode batch that runs again and again, with what a decode step reads of each kept in
    arrays: its length (``num_kv``) and its boundary block (the table's last entry), so `reserve_step` serves
    the whole batch in a few array operations instead of a pass over the sequences.

    The arrays stay true only while `reserve_step` is the one thing that grows or remaps these sequences: the
    engine keeps one while it decodes the same requests in the same order, and builds a new one otherwise.
    """

    def __init__(self, seqs: list[SeqKV]) -> None:
        self.seqs = seqs
        n = len(seqs)
        self.num_kv = np.fromiter((seq.num_kv for seq in seqs), dtype=np.int64, count=n)
        self.last_block = np.fromiter((seq.table[-1] for seq in seqs), dtype=np.int64, count=n)


@dataclass
class CacheCounters:
    """Monotonic counters of the sequence side."""

    cow_copies: int = 0


@dataclass
class KVCacheManager:
    """Owns the block pool and the radix tree; hands out, shares and reclaims KV blocks for sequences.

    With ``enable_prefix_cache=False`` nothing is matched or published: every sequence computes and owns
    all of its blocks.
    """

    num_blocks: int
    block_size: int
    enable_prefix_cache: bool = True
    pool: BlockPool = field(init=False)
    tree: RadixTree = field(init=False)
    counters: CacheCounters = field(init=False, default_factory=CacheCounters)
    # Blocks touched since the last forward was issued -> their fill before that (slots below it are written).
    _written_fill: dict[int, int] = field(init=False, default_factory=dict)
    # The last `cached_prefix_len` walk: (token array, salt, walk). A scheduler peeks at a request's cost and
    # then admits it with nothing changed in between: `admit` takes the peek as its match.
    _last_peek: tuple[TokenArray, Hashable, TreeWalk] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.tree = RadixTree(self.pool)

    # ------------------------------------------------------------------ admission
    def admit(
        self, tokens: Sequence[int] | TokenArray, salt: Hashable = None, *, use_cache: bool = True
    ) -> SeqKV:
        """Match ``tokens`` and lock what the match reads; the sequence starts with the matched blocks (no
        allocation yet, so admission itself never fails). The caller then `reserve`s the positions to compute.

        A match that ends inside a node's edge splits the node there first, so the lock pins only the blocks
        of the matched positions: the rest of the edge stays evictable while the request waits for memory.
        ``use_cache=False`` admits as a miss (matches and locks nothing, publishing still works): the
        fallback for a request whose locked hit keeps it from fitting a pool it would fit alone."""
        if not (self.enable_prefix_cache and use_cache):
            return SeqKV(salt, [], 0, 0, None, None)
        tokens = as_token_array(tokens)
        match = self._peeked(tokens, salt) or self.tree.match(tokens, salt)
        if match.length and match.length < match.node.end:
            match = MatchResult(
                match.length, match.blocks, self.tree.split_at(match.node, match.length), None
            )
        self.tree.lock(match.node)
        self.pool.incref(match.blocks)
        node = (
            match.node if match.length else None
        )  # an empty match reaches only the root: nothing to lock
        return SeqKV(
            salt,
            list(match.blocks),
            match.length,
            match.length,
            match.payload,
            node,
            match=TreeWalk(match, len(tokens), self.tree.version),
        )

    def cached_prefix_len(self, tokens: Sequence[int] | TokenArray, salt: Hashable = None) -> int:
        """How many leading tokens `admit` would find cached right now (changes nothing, counts nothing)."""
        if not self.enable_prefix_cache:
            return 0
        tokens = as_token_array(tokens)
        peek = self._peeked(tokens, salt) or self.tree.match(tokens, salt)
        self._last_peek = (tokens, salt, TreeWalk(peek, len(tokens), self.tree.version))
        return peek.length

    def _peeked(self, tokens: TokenArray, salt: Hashable) -> MatchResult | None:
        """The last peek, when it was of this very array under this salt and the tree has not changed since."""
        last = self._last_peek
        if last is not None and last[0] is tokens and last[1] == salt:
            return last[2].walk_of(len(tokens), self.tree.version)
        return None

    def blocks_needed(self, seq: SeqKV, new_len: int) -> int:
        """Fresh blocks `reserve` would take to grow ``seq`` to ``new_len`` positions (copy included)."""
        return self._blocks_needed([seq], [new_len])

    def needs_copy_of_unwritten(self, seq: SeqKV, new_len: int) -> bool:
        """Whether growing ``seq`` would copy a block whose K/V the current forward has not written yet.
        Such a sequence must wait for the next pass (the copy runs before the forward).

        Exact for a `reserve` of ``seq`` alone. In one batched `reserve`, a sequence that claims the next slot
        of a shared block makes a later one at the same offset copy it, so batch only after `mark_written`."""
        if not self._needs_copy(seq, new_len):
            return False
        return seq.num_kv % self.block_size > self._written_fill.get(seq.table[-1], self.block_size)

    def _needs_copy(self, seq: SeqKV, new_len: int) -> bool:
        offset = seq.num_kv % self.block_size
        if offset == 0 or new_len <= seq.num_kv:
            return False
        last = seq.table[-1]
        return self.pool.fill[last] != offset and self.pool.refcount[last] > 1

    # ------------------------------------------------------------------ growth
    def reserve(
        self, seqs: Sequence[SeqKV], new_lens: Sequence[int] | None = None
    ) -> ReservePlan | None:
        """Give each sequence slots for positions ``num_kv .. new_len - 1`` (``new_lens`` None: one more
        position each, a decode step), all or nothing.

        Evicts unlocked LRU leaves if the pool is short. Returns None and changes nothing but the eviction
        when memory is still short (the caller preempts or waits). Copy-on-write of the boundary block is
        planned here and batched for all sequences of the call.
        """
        bs = self.block_size
        pool = self.pool
        # Growing by g positions takes at most ceil((g - 1) / bs) + 1 blocks, a copy included (one block for a
        # decode step). With that many free, skip the exact count (a second pass over the batch) and eviction.
        one_each = (
            new_lens is None
        )  # a decode step: the loop below derives each new length, no list built
        if one_each:
            most = len(seqs)
        else:
            most = sum(
                (n - seq.num_kv + bs - 2) // bs + 1
                for seq, n in zip(seqs, new_lens)
                if n > seq.num_kv
            )
        if pool.num_free < most and not self.ensure_free(
            self._blocks_needed(seqs, [seq.num_kv + 1 for seq in seqs] if one_each else new_lens)
        ):
            return None
        fill, refcount = pool.fill, pool.refcount
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        changed: list[int] = []
        written_fill = self._written_fill
        for i, seq in enumerate(seqs):
            start = seq.num_kv
            new_len = start + 1 if one_each else new_lens[i]
            if new_len <= start:
                continue
            table = seq.table
            offset = start % bs
            if offset:
                last = table[-1]
                if fill[last] != offset and refcount[last] > 1:
                    copy = pool.fork(last)
                    copies.append((last, copy))
                    changed.append(i)
                    table[-1] = last = copy
                    written_fill[copy] = (
                        0  # even its first `offset` slots arrive only with the copy
                    )
                elif written_fill.get(last, bs) > offset:
                    # Slots from `offset` on are written by this forward (a sole holder may rewrite stale ones).
                    written_fill[last] = offset
                end = offset + new_len - start
                if (
                    end <= bs
                ):  # the growth stays inside the boundary block (a decode step, 15 times in 16)
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
                    shift = (
                        table[index] - index
                    ) * bs  # slot of position p in this block: p + shift
                    slots.extend(
                        range(
                            max(start, index * bs) + shift, min(new_len, (index + 1) * bs) + shift
                        )
                    )
            seq.num_kv = new_len
        self.counters.cow_copies += len(copies)
        return ReservePlan(slots, copies, changed)

    def reserve_step(self, lanes: DecodeLanes) -> ReservePlan | None:
        """``reserve(lanes.seqs)`` (one more position each, all or nothing), vectorised for the two usual
        cases: the position starts a block (the sequence takes a fresh one), or it falls inside a boundary
        block the sequence holds alone (it writes there in place). Nothing else can read or copy such a block
        (it is in no tree node and no other table), so neither the order of the batch nor the written-fill
        record (consulted only for copies of shared blocks) matters for it. The rest, a shared boundary block
        (claim or copy-on-write), go through `reserve` in batch order; they never touch a block that one of
        the usual sequences holds, so serving them first is serving the batch in order."""
        bs, pool, seqs = self.block_size, self.pool, lanes.seqs
        last, offset = lanes.last_block, lanes.num_kv % bs
        fresh = offset == 0
        own = fresh | (pool.refcount_view[last] == 1)
        fresh_rows = np.flatnonzero(fresh)
        shared = np.flatnonzero(~own)
        shared_seqs = [seqs[i] for i in shared.tolist()]
        most = len(fresh_rows) + len(
            shared_seqs
        )  # one block each at most (a copy or a fresh block)
        if pool.num_free < most and not self.ensure_free(
            len(fresh_rows)
            + self._blocks_needed(shared_seqs, [seq.num_kv + 1 for seq in shared_seqs])
        ):
            return None
        copies: list[tuple[int, int]] = []
        changed = fresh_rows
        if shared_seqs:  # cannot fail now: the blocks are free
            plan = self.reserve(shared_seqs)
            copies = plan.copies
            changed = np.union1d(fresh_rows, shared[plan.changed])
            last[shared] = [seq.table[-1] for seq in shared_seqs]
        if len(fresh_rows):
            blocks = pool.allocate(len(fresh_rows))
            for i, block in zip(fresh_rows.tolist(), blocks):
                seqs[i].table.append(block)
            last[fresh_rows] = blocks
        slots = last * bs + offset
        if shared_seqs:
            slots[shared] = plan.slots
            pool.fill_view[last[own]] = offset[own] + 1
            owned: Sequence[SeqKV] = list(itertools.compress(seqs, own.tolist()))
        else:
            pool.fill_view[last] = offset + 1
            owned = seqs
        for seq in owned:
            seq.num_kv += 1
        lanes.num_kv += 1
        return ReservePlan(slots, copies, changed.tolist())

    def _blocks_needed(self, seqs: Sequence[SeqKV], new_lens: Sequence[int]) -> int:
        """Fresh blocks `reserve` takes for the batch, copies included. The batch is replayed in order, as
        `reserve` serves it: a sequence that claims the next slot of a shared block makes a later one at the
        same offset copy the block, and one that copies leaves the block with one holder fewer. (Eviction
        between this count and the allocations only drops holders, so it can only save copies.)"""
        bs = self.block_size
        fill, refcount = self.pool.fill, self.pool.refcount
        fill_after: dict[
            int, int
        ] = {}  # boundary block -> its fill once earlier sequences of the batch wrote
        copied_away: dict[
            int, int
        ] = {}  # boundary block -> earlier sequences of the batch that copied it
        need = 0
        for seq, new_len in zip(seqs, new_lens):
            start = seq.num_kv
            if new_len <= start:
                continue
            need += -(-new_len // bs) - len(seq.table)
            offset = start % bs
            if offset:
                last = seq.table[-1]
                if (
                    fill_after.get(last, fill[last]) != offset
                    and refcount[last] - copied_away.get(last, 0) > 1
                ):
                    need += 1
                    copied_away[last] = copied_away.get(last, 0) + 1
                else:
                    fill_after[last] = min(bs, offset + new_len - start)
        return need

    def mark_written(self) -> None:
        """The forward that writes every slot reserved so far has been issued: later copies may read them.
        Release a sequence only after this (its blocks may be handed out again at once)."""
        self._written_fill.clear()

    def ensure_free(self, num_blocks: int) -> bool:
        """Make at least ``num_blocks`` blocks free, evicting LRU tree leaves if needed."""
        short = num_blocks - self.pool.num_free
        if short > 0 and self.enable_prefix_cache:
            self.tree.evict(short)
        return self.pool.num_free >= num_blocks

    # ------------------------------------------------------------------ publishing
    def publish(
        self, seq: SeqKV, tokens: Sequence[int] | TokenArray, *, prompt_end: bool = False
    ) -> int:
        """Insert ``tokens`` (the sequence's first ``len(tokens) <= num_kv`` tokens) into the tree so others
        reuse them, point the table at blocks the tree already held (then release the duplicates), and move
        the sequence's lock to the deepest node of its path. With ``prompt_end`` a node ends exactly at
        ``len(tokens)`` so `attach_payload` can store the prompt's final hidden state there.
        Returns the number of tokens that were new to the tree."""
        if not self.enable_prefix_cache or len(tokens) == 0:
            return 0
        result = self._insert(seq, tokens, prompt_end=prompt_end, lock=True)
        # A duplicate the current forward still has to write stays until a later publish: freed now, it could
        # be handed out again and written twice by one forward.
        remap = [(k, b) for k, b in result.remap if seq.table[k] not in self._written_fill]
        if remap:
            old = [seq.table[k] for k, _ in remap]
            self.pool.incref([b for _, b in remap])
            for k, b in remap:
                seq.table[k] = b
            self.pool.decref(old)  # remap first, then free (invariant 7)
        if seq.node is not None:
            self.tree.unlock(seq.node)
        seq.node = result.node
        return result.new_tokens

    def _insert(
        self, seq: SeqKV, tokens: Sequence[int] | TokenArray, prompt_end: bool, lock: bool
    ) -> InsertResult:
        assert len(tokens) <= seq.num_kv, "publishing positions whose KV is not stored"
        walked = (
            seq.match.walk_of(len(tokens), self.tree.version) if seq.match is not None else None
        )
        seq.match = None
        return self.tree.insert(
            as_token_array(tokens),
            seq.table,
            seq.salt,
            end_node=prompt_end,
            walked=walked,
            lock=lock,
        )

    def attach_payload(self, seq: SeqKV, payload: Any) -> None:
        """Store the final hidden state of the prompt's last position on the node ending there (published
        with ``prompt_end=True``), so an exact repeat computes no attention or MLP."""
        if seq.node is not None and seq.node.end == seq.num_kv:
            self.tree.attach_payload(seq.node, payload)

    # ------------------------------------------------------------------ release
    def release(self, seq: SeqKV, publish: Sequence[int] | TokenArray | None = None) -> int:
        """Unlock and drop every block reference (finish, abort, preemption). Idempotent.

        ``publish``: first insert these tokens (the sequence's first ``len(publish) <= num_kv``) into the tree,
        as `publish` does, for what a finished or preempted request computed. Cheaper than `publish` then
        `release`: the new path goes into the LRU set unlocked (not locked only to be unlocked), and nothing is
        remapped (every reference of the sequence is dropped anyway; the tree keeps its own blocks). Returns
        the number of tokens new to the tree."""
        if seq.released:
            return 0
        new_tokens = 0
        if publish is not None and self.enable_prefix_cache and len(publish):
            new_tokens = self._insert(seq, publish, prompt_end=False, lock=False).new_tokens
        seq.released = True
        if seq.node is not None:
            self.tree.unlock(seq.node)
            seq.node = None
        self.pool.decref(seq.table)
        seq.table = []
        return new_tokens

    def reset(self) -> None:
        """Empty the prefix cache. Only valid when no sequence is live."""
        self.tree.reset()
        self._written_fill.clear()
        self._last_peek = None

    # ------------------------------------------------------------------ inspection
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def check_integrity(self, live: Sequence[SeqKV]) -> None:
        """Assert docs/invariants.md invariant 1 (refcount = holders), the pool's and the tree's own invariants, and
        that every live sequence's lock is on a node still in the tree."""
        holders = self.tree.block_holders()
        for seq in live:
            assert not seq.released
            assert len(seq.table) == -(-seq.num_kv // self.block_size), (
                f"table/num_kv mismatch {seq}"
            )
            for b in seq.table:
                holders[b] = holders.get(b, 0) + 1
            if seq.node is not None:
                assert seq.node.lock_count > 0
        self.pool.check_integrity(holders)
        self.tree.check_integrity()
