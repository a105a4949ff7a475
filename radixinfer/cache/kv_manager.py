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
it) or it holds ``B`` alone; otherwise it copies ``B`` to a fresh block first (copy-on-write; the rule
is `BlockPool.must_copy`)::

    tree:  [a b c d | e f g .]   B (fill 3)       seq with path "a b c d e f x":
    seq:   [a b c d | e f x .]   B' = copy(B), then write "x" at offset 2 of B'

Copies are returned to the caller, who performs all of a step's copies in one batched launch *before*
the step's K/V writes.

With a host tier (``host_blocks > 0``), eviction writes LRU tails back to host blocks and `admit`
loads a match's host-resident part back into GPU blocks (`RadixTree.evict`, `HostResidency.load`). The
copies between the tiers are queued: the caller runs `take_transfers` before the step's block
copies.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixinfer.cache.block_pool import BlockPool
from radixinfer.cache.decode_step import DecodeLanes, reserve_step
from radixinfer.cache.growth import plan_growth
from radixinfer.cache.host_tier import HostTier, TransferBatch
from radixinfer.cache.radix_tree import RadixTree
from radixinfer.cache.sequence import ReservePlan, SeqKV, TreeWalk
from radixinfer.cache.tree_node import (
    InsertResult,
    MatchResult,
    TokenArray,
    as_token_array,
)

__all__ = [
    "CacheCounters",
    "DecodeLanes",
    "KVCacheManager",
    "ReservePlan",
    "SeqKV",
    "TransferBatch",
    "TreeWalk",
]


@dataclass
class CacheCounters:
    """Monotonic counters of the sequence side."""

    cow_copies: int = 0


@dataclass
class KVCacheManager:
    """Owns the block pool and the radix tree; hands out, shares and reclaims KV blocks for sequences.

    With ``enable_prefix_cache=False`` nothing is matched or published: every sequence computes and
    owns all of its blocks. ``host_blocks > 0`` (prefix cache on) puts a host tier of that many
    blocks under the GPU pool (``host``; None without one); ``host_write_through_hits`` k (None:
    off) copies a prefix to it while still on the GPU once more than k admissions matched it
    (`HostResidency`).
    """

    num_blocks: int
    block_size: int
    enable_prefix_cache: bool = True
    host_blocks: int = 0
    host_write_through_hits: int | None = None
    pool: BlockPool = field(init=False)
    tree: RadixTree = field(init=False)
    host: HostTier | None = field(init=False, default=None)
    counters: CacheCounters = field(init=False, default_factory=CacheCounters)
    # Blocks touched since the last forward was issued -> their fill before that (slots below it are written).
    _written_fill: dict[int, int] = field(init=False, default_factory=dict)
    # The last `cached_prefix_len` walk: (token array, salt, walk). A scheduler peeks at a request's cost and
    # then admits it with nothing changed in between: `admit` takes the peek as its match.
    _last_peek: tuple[TokenArray, Hashable, TreeWalk] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.block_size)
        if self.host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {self.host_blocks}")
        if self.host_blocks and not self.enable_prefix_cache:
            raise ValueError("a host tier (host_blocks > 0) needs the prefix cache enabled")
        hits = self.host_write_through_hits
        if hits is not None and not self.host_blocks:
            raise ValueError("host_write_through_hits needs a host tier (host_blocks > 0)")
        if self.host_blocks:
            self.host = HostTier(self.host_blocks, self.block_size)
        self.tree = RadixTree(self.pool, self.host, hits)

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        tokens: Sequence[int] | TokenArray,
        salt: Hashable = None,
        *,
        use_cache: bool = True,
        then_takes: Callable[[int], int] | None = None,
    ) -> SeqKV:
        """Match ``tokens`` and lock what the match reads; the sequence starts with the matched blocks (no
        block of its own yet, so admission itself never fails). The caller then `reserve`s the
        positions to compute.

        A match that ends inside a node's edge splits the node there first, so the lock pins only the blocks
        of the matched positions: the rest of the edge stays evictable while the request waits for memory.
        ``use_cache=False`` admits as a miss (matches and locks nothing, publishing still works): the
        fallback for a request whose locked hit keeps it from fitting a pool it would fit alone.

        With a host tier, a match that goes on through host-resident nodes loads them into fresh GPU
        blocks, top down, as far as GPU blocks can be made free (`ensure_free`) for them and for
        the ``then_takes(length)`` blocks the caller reserves right after, when the match ends at
        ``length`` (None: none); the match ends where loading stopped, and the sequence computes
        the rest (``num_loaded``: tokens loaded). With the caller's whole reservation counted, a
        load is never made for a request that then finds no room and gives its loaded blocks
        back (evictable again, so loaded again at its next attempt). A host-resident part
        shorter than a block is computed, not loaded (`_loads`)."""
        if not (self.enable_prefix_cache and use_cache):
            return SeqKV(salt, [], 0, 0, None, None)
        tokens = as_token_array(tokens)
        match = self._peeked(tokens, salt) or self.tree.match(tokens, salt)
        num_loaded = 0
        if match.host_node is not None and self._loads(match):
            gpu_length = match.length
            takes = then_takes or (lambda length: 0)
            match = self.tree.tiers.load_match(
                match, len(tokens), lambda n, length: self.ensure_free(n + takes(length))
            )
            num_loaded = match.length - gpu_length
        elif match.host_node is None and match.length and match.length < match.node.end:
            match = MatchResult(
                match.length, match.blocks, self.tree.split_at(match.node, match.length), None
            )
        self.tree.lock(match.node)
        self.pool.incref(match.blocks)
        node = match.node if match.length else None  # an empty match reaches only the root
        if node is not None and self.host_write_through_hits is not None:
            self.tree.tiers.count_hit(node, self._written_fill)
        return SeqKV(
            salt,
            list(match.blocks),
            match.length,
            match.length,
            match.payload,
            node,
            match=TreeWalk(match, len(tokens), self.tree.version),
            num_loaded=num_loaded,
        )

    def cached_prefix_len(self, tokens: Sequence[int] | TokenArray, salt: Hashable = None) -> int:
        """How many leading tokens `admit` would find cached right now (changes nothing, counts nothing)."""
        if not self.enable_prefix_cache:
            return 0
        tokens = as_token_array(tokens)
        peek = self._peeked(tokens, salt) or self.tree.match(tokens, salt)
        self._last_peek = (tokens, salt, TreeWalk(peek, len(tokens), self.tree.version))
        return (
            peek.total_length if peek.host_node is not None and self._loads(peek) else peek.length
        )

    def _loads(self, match: MatchResult) -> bool:
        """Whether `admit` loads the host-resident part of ``match``: when it covers at least a
        block's worth of positions. A shorter one costs the request a wait for its load (a step
        or more) to save computing fewer positions than a block holds: it is computed, and its
        publish takes the host-resident nodes' place (`HostResidency.promote`)."""
        return match.host_node is not None and match.host_length - match.length >= self.block_size

    def _peeked(self, tokens: TokenArray, salt: Hashable) -> MatchResult | None:
        """The last peek, when it was of this very array under this salt and the tree has not changed since."""
        last = self._last_peek
        if last is not None and last[0] is tokens and last[1] == salt:
            return last[2].walk_of(len(tokens), self.tree.version)
        return None

    def needs_copy_of_unwritten(self, seq: SeqKV, new_len: int) -> bool:
        """Whether growing ``seq`` would copy a block whose K/V the current forward has not written yet.
        Such a sequence must wait for the next pass (the copy runs before the forward).

        Exact for a `reserve` of ``seq`` alone. In one batched `reserve`, a sequence that claims the next slot
        of a shared block makes a later one at the same offset copy it, so batch only after `mark_written`."""
        offset = seq.num_kv % self.block_size
        if offset == 0 or new_len <= seq.num_kv or not self.pool.must_copy(seq.table[-1], offset):
            return False
        return offset > self._written_fill.get(seq.table[-1], self.block_size)

    def fork(self, seq: SeqKV) -> SeqKV:
        """Another sample of ``seq``'s prompt: its blocks (one more reference each) and lock. Nothing
        is copied now; their shared boundary block follows `BlockPool.must_copy` on write."""
        if seq.node is not None:
            self.tree.lock(seq.node)
        self.pool.incref(seq.table)
        return SeqKV(seq.salt, list(seq.table), seq.num_kv, seq.num_cached, seq.payload, seq.node)

    # ------------------------------------------------------------------ growth
    def reserve(
        self,
        seqs: Sequence[SeqKV],
        new_lens: Sequence[int] | None = None,
        keep_free: int = 0,
    ) -> ReservePlan | None:
        """Give each sequence slots for positions ``num_kv .. new_len - 1`` (``new_lens`` None: one more
        position each, a decode step), all or nothing, leaving at least ``keep_free`` blocks free after
        it (evicting for them too).

        Evicts unlocked LRU leaves if the pool is short. Returns None and changes nothing but the eviction
        when memory is still short (the caller preempts or waits). Copy-on-write of the boundary block is
        planned here (`BlockPool.must_copy`) and batched for all sequences of the call.
        """
        bs = self.block_size
        # Growing by g positions takes at most ceil((g - 1) / bs) + 1 blocks, a copy included (one block for a
        # decode step). With that many free, skip the exact count (a dry run over the batch) and eviction.
        if new_lens is None:
            most = len(seqs)
        else:
            most = sum(
                (n - seq.num_kv + bs - 2) // bs + 1
                for seq, n in zip(seqs, new_lens)
                if n > seq.num_kv
            )
        if self.pool.num_free < most + keep_free and not self.ensure_free(
            self.blocks_needed(seqs, new_lens) + keep_free
        ):
            return None
        plan, _ = plan_growth(self.pool, self._written_fill, seqs, new_lens, dry_run=False)
        self.counters.cow_copies += len(plan.copies)
        return plan

    def blocks_needed(self, seqs: Sequence[SeqKV], new_lens: Sequence[int] | None = None) -> int:
        """Fresh blocks ``reserve(seqs, new_lens)`` would take, copies included; changes nothing. A dry run
        of `reserve`'s own planning. (Eviction between this count and the allocations only drops holders, so
        it can only save copies.)"""
        _, need = plan_growth(self.pool, self._written_fill, seqs, new_lens, dry_run=True)
        return need

    def reserve_step(self, lanes: DecodeLanes) -> ReservePlan | None:
        """``reserve(lanes.seqs)`` for a decode batch that runs again and again, in a few array operations
        (`radixinfer.cache.decode_step.reserve_step`)."""
        return reserve_step(self, lanes)

    def note_in_place_writes(self, blocks: Sequence[int], offsets: Sequence[int]) -> None:
        """Record that the forward being planned writes ``blocks[i]`` in place from slot ``offsets[i]`` on
        (`reserve` records its own): until `mark_written`, no copy may read those slots."""
        written_fill, bs = self._written_fill, self.block_size
        for block, offset in zip(blocks, offsets):
            if written_fill.get(block, bs) > offset:
                written_fill[block] = offset

    def mark_written(self) -> None:
        """The forward that writes every slot reserved so far has been issued: later copies may read them.
        Release a sequence only after this (its blocks may be handed out again at once)."""
        self._written_fill.clear()

    def ensure_free(self, num_blocks: int) -> bool:
        """Make at least ``num_blocks`` blocks free, evicting LRU tree leaves if needed."""
        short = num_blocks - self.pool.num_free
        if short > 0 and self.enable_prefix_cache:
            self.tree.evict(short, self._written_fill)
        return self.pool.num_free >= num_blocks

    def take_transfers(self) -> list[TransferBatch]:
        """The host tier's queued block copies, in the order they must run (before the next block
        copy or forward); empty without a host tier."""
        return self.host.take_transfers() if self.host is not None else []

    def is_loading(self, seq: SeqKV) -> bool:
        """Whether a block ``seq`` reads may still be arriving from the host tier: no forward or
        copy may read its blocks until `HostTier.finish_loads` says its loads completed."""
        return self.host is not None and self.host.is_loading(seq.table)

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
        # A duplicate the current forward still has to write stays until a later publish (freed now, it could
        # be handed out again and written twice by one forward); a loading tree block replaces nothing.
        remap = [(k, b) for k, b in result.remap if seq.table[k] not in self._written_fill]
        if remap and self.host is not None:
            remap = [(k, b) for k, b in remap if not self.host.is_loading((b,))]
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
        if self.host is not None:
            self.host.pool.check_integrity(self.tree.block_holders(host=True))
        self.tree.check_integrity()
