"""The engine-like driver both cache state machines build on: shared state, checked steps, invariants.

The driver plays the engine against a `KVCacheManager`: it admits requests (match + lock), reserves their
slots, publishes paths, ends requests. Each step is checked against an independent model:

* **Cached paths** (`kv_model.add_path` sets per salt): what has been published, shrunk only after an
  eviction to what the tree still holds (and checked never to grow there). Match lengths, payloads and the
  new-token counts of `publish` are predicted from it.
* **Locks**: each request remembers the prefix it holds locked (its match, then its last publish); no
  eviction may remove it (invariant 5).
* **KV content** (`kv_model.FakeKV`): every plan is checked before the subclass applies it: copies go only
  into blocks no other holder reads, writes only onto slots nobody reads (invariant 2). Reading back every
  live sequence and tree node checks invariant 4.
* **Host tier** (machines with ``host_tier``; a pool of 0..8 host blocks, 0 = none): eviction writes
  tails back to the host and admission loads them again, so published paths survive eviction as long
  as the host has room. The queued transfers are applied to the fake stores right after the step
  that queued them; every node then reads back its own path's KV from whichever tier holds it, after
  any number of round trips, and both pools' refcounts equal their holders.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass

from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant

from property_tests.kv_model import (
    FakeKV,
    add_path,
    check_holders,
    check_monotonic,
    check_tree_reads_back,
    counters,
    kv_value,
    longest_match,
    readers,
    slot_of,
    tree_paths,
)
from radixinfer.cache.kv_manager import DecodeLanes, KVCacheManager, ReservePlan, SeqKV
from radixinfer.cache.tree_node import path_tokens

TOKENS = st.integers(0, 2)
SALTS = st.sampled_from([None, "tenant-a", "tenant-b"])
MAX_PROMPT = 12
MAX_LEN = 18  # a request stops growing here (the machine finishes it at random later)
PICK = st.integers(
    0, 15
)  # an index into a list (live requests, past prompts), taken modulo its length
# A prompt is a prefix of an earlier prompt or finished conversation plus a few new tokens, so exact
# repeats, shared prefixes and multi-turn continuations are common (see `CacheDriver._compose`).
PROMPT_PARTS = dict(base=PICK, keep=st.integers(0, MAX_PROMPT), suffix=st.lists(TOKENS, max_size=6))


def payload_of(salt: Hashable, prompt: tuple[int, ...]) -> tuple:
    return ("hidden state", salt, prompt)


@dataclass(eq=False)
class Req:
    rid: int
    seq: SeqKV
    salt: Hashable
    tokens: list[int]  # tokens whose KV is stored (or scheduled): len(tokens) == seq.num_kv
    locked_len: int  # the prefix of `tokens` this request holds locked in the tree


@dataclass(frozen=True)
class Write:
    slot: int
    value: tuple


class CacheDriver(RuleBasedStateMachine):
    host_tier = True  # whether `make_cache` may put a host tier under the pool

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, Req] = {}
        self.rids = itertools.count()
        self.paths: dict[Hashable, set[tuple[int, ...]]] = defaultdict(set)
        self.payloads: dict[tuple[Hashable, tuple[int, ...]], tuple] = {}
        self.history: list[list[int]] = []  # recent prompts and finished requests' tokens

    @initialize(
        block_size=st.integers(1, 8),
        capacity_tokens=st.integers(4, 48),
        host_blocks=st.integers(0, 8),
        write_through=st.sampled_from([None, 0, 1]),
    )
    def make_cache(
        self, block_size: int, capacity_tokens: int, host_blocks: int, write_through: int | None
    ) -> None:
        """Pools of 4..48 tokens: small enough that eviction and out-of-memory run all the time;
        host pools of 0..8 blocks, small enough that the host tier evicts too, with write-through
        after ``write_through`` hits or without."""
        host_blocks = host_blocks if self.host_tier else 0
        self.mgr = KVCacheManager(
            num_blocks=-(-capacity_tokens // block_size),
            block_size=block_size,
            host_blocks=host_blocks,
            host_write_through_hits=write_through if host_blocks else None,
        )
        self.bs = block_size
        self.kv = FakeKV(block_size)
        self.last_counters = counters(self.mgr)

    def kv_settled(self) -> bool:
        """Whether every scheduled write has been applied to the fake store (so content can be checked)."""
        return True

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        self.mgr.check_integrity([r.seq for r in self.live.values()])
        check_holders(self.mgr, {rid: (r.salt, r.seq) for rid, r in self.live.items()})
        for req in self.live.values():
            assert req.seq.node is None or not req.seq.node.host, "a locked node is host-resident"

    @invariant()
    def kv_reads_back(self) -> None:
        """Invariant 4: every live sequence and every tree node reads exactly its own prefixes' KV."""
        if not self.kv_settled():
            return
        check_tree_reads_back(self.mgr, self.kv)
        for req in self.live.values():
            assert len(req.tokens) == req.seq.num_kv
            want = [kv_value(req.salt, req.tokens[: p + 1]) for p in range(len(req.tokens))]
            assert self.kv.read(req.seq.table, req.seq.num_kv) == want, (
                f"request {req.rid} reads wrong KV"
            )

    @invariant()
    def tree_holds_exactly_the_published_paths(self) -> None:
        tree = tree_paths(self.mgr)
        for salt in set(tree) | set(self.paths):
            for path in self.paths[salt]:
                assert longest_match(path, tree[salt]) == len(path), (
                    f"published {path} lost without eviction"
                )
            for path in tree[salt]:
                assert longest_match(path, self.paths[salt]) == len(path), (
                    f"tree holds unpublished {path}"
                )

    @invariant()
    def counters_monotonic(self) -> None:
        now = counters(self.mgr)
        check_monotonic(self.last_counters, now)
        self.last_counters = now

    # ------------------------------------------------------------------ checked steps
    def _pick(self, pick: int, items: list | None = None):
        items = list(self.live.values()) if items is None else items
        return items[pick % len(items)]

    def _compose(self, base: int, keep: int, suffix: list[int]) -> list[int]:
        """``keep`` tokens of a recent prompt or conversation, then ``suffix`` (never empty)."""
        prefix = self._pick(base, self.history)[:keep] if self.history else []
        prompt = (prefix + suffix)[:MAX_PROMPT] or [0]
        note(f"prompt {prompt}")
        return prompt

    def _remember(self, tokens: list[int]) -> None:
        self.history = [*self.history[-15:], list(tokens)]

    def _admit(self, prompt: list[int], salt: Hashable) -> Req:
        """Match + lock; the match length (token-granular, salt-scoped) and payload must match the
        model. With a host tier the host-resident part of the match is loaded back as far as GPU
        blocks can be made free: the match covers at least what was GPU-resident, and all of it when
        nothing failed."""
        want = longest_match(prompt, self.paths[salt])
        on_gpu = longest_match(prompt, tree_paths(self.mgr, gpu_only=True)[salt])
        loaded = self.mgr.host.counters.loaded_tokens if self.mgr.host is not None else 0
        seq = self.mgr.admit(prompt, salt)
        assert seq.num_kv == seq.num_cached
        if self.mgr.host is None:
            assert seq.num_kv == want, f"matched {seq.num_kv}, longest cached prefix is {want}"
        else:
            assert on_gpu <= seq.num_kv <= want, f"matched {seq.num_kv}, cached {on_gpu}..{want}"
            assert seq.num_loaded == seq.num_kv - on_gpu
            assert self.mgr.host.counters.loaded_tokens - loaded >= seq.num_loaded
            event(
                "admit: loaded from the host"
                if seq.num_loaded
                else "admit: load fell back"
                if seq.num_kv < want
                else "admit: GPU hit or miss"
            )
            self._transfer()
        want_payload = (
            self.payloads.get((salt, tuple(prompt))) if seq.num_kv == len(prompt) else None
        )
        assert seq.payload == want_payload
        req = Req(next(self.rids), seq, salt, prompt[: seq.num_kv], seq.num_kv)
        self.live[req.rid] = req
        self._remember(prompt)
        self._sync_after_eviction()
        return req

    def _transfer(self) -> None:
        """Run the host tier's queued copies on the fake stores (before the step's copies and
        writes)."""
        self.kv.apply_transfers(self.mgr.take_transfers())
        if self.mgr.host is not None:  # the fake copies are done at once
            self.mgr.host.finish_loads(self.mgr.host.tickets_taken)

    def _reserve(
        self, reqs: list[Req], new_tokens: list[list[int]], lanes: bool = False
    ) -> tuple[ReservePlan, list[Write]] | None:
        """`reserve` for ``reqs`` in one call (with ``lanes``, a decode step of one token each: `reserve_step`
        over `DecodeLanes` of them). Checks the plan against the tables and invariant 2, appends the tokens to
        the requests and returns the plan with the writes to apply (after ``plan.copies``).
        None (and nothing changed) when memory is short."""
        bs = self.bs
        seqs = [r.seq for r in reqs]
        before = [(list(s.table), s.num_kv) for s in seqs]
        cow_copies = self.mgr.counters.cow_copies
        if lanes:
            assert all(len(t) == 1 for t in new_tokens)
            # the vectorised cases: a fresh block, or a boundary block held alone (the rest go through reserve)
            own = sum(s.num_kv % bs == 0 or self.mgr.pool.refcount[s.table[-1]] == 1 for s in seqs)
            event(
                f"reserve_step: {'all' if own == len(seqs) else 'some' if own else 'none'} vectorised"
            )
            decode_lanes = DecodeLanes(seqs)
            plan = self.mgr.reserve_step(decode_lanes)
            if plan is not None:
                assert decode_lanes.num_kv.tolist() == [s.num_kv for s in seqs]
                assert decode_lanes.last_block.tolist() == [s.table[-1] for s in seqs]
        else:
            plan = self.mgr.reserve(seqs, [s.num_kv + len(t) for s, t in zip(seqs, new_tokens)])
        self._transfer()  # what the eviction wrote back is read now, before any later write
        self._sync_after_eviction()
        if plan is None:
            event("reserve: out of memory")
            assert [(s.table, s.num_kv) for s in seqs] == before, (
                "a failed reserve changed a sequence"
            )
            assert self.mgr.counters.cow_copies == cow_copies
            return None
        assert self.mgr.counters.cow_copies == cow_copies + len(plan.copies)
        if plan.copies:
            event("reserve: copy-on-write")
        # Who reads what once the step's blocks are in place (batch members: only their old positions).
        reading = {rid: (r.seq, r.seq.num_kv) for rid, r in self.live.items()}
        reading.update({r.rid: (r.seq, num_kv) for r, (_, num_kv) in zip(reqs, before)})
        slot_readers = readers(self.mgr, reading)

        want_copies = []
        for req, (table, num_kv) in zip(reqs, before):
            kept = max(len(table) - 1, 0)
            assert req.seq.table[:kept] == table[:kept], "reserve changed a full block of a table"
            if table and req.seq.table[len(table) - 1] != table[-1]:
                assert num_kv % bs, "a full block was copied"
                dst = req.seq.table[len(table) - 1]
                want_copies.append((table[-1], dst))
                for o in range(bs):
                    others = slot_readers.get(dst * bs + o, set()) - {("seq", req.rid)}
                    assert not others, f"copy into block {dst}, which {others} read"
        assert sorted(plan.copies) == sorted(want_copies), "copies do not match the tables' changes"
        assert plan.changed == [
            i for i, (r, (table, _)) in enumerate(zip(reqs, before)) if r.seq.table != table
        ]

        writes = []
        for req, (_, num_kv), tokens in zip(reqs, before, new_tokens):
            for p, token in enumerate(tokens, start=num_kv):
                slot = slot_of(req.seq.table, p, bs)
                assert not slot_readers.get(slot), (
                    f"write-once: slot {slot} is read by {slot_readers[slot]}"
                )
                req.tokens.append(token)
                writes.append(Write(slot, kv_value(req.salt, req.tokens)))
        assert list(plan.slots) == [w.slot for w in writes], "plan slots do not match the tables"
        assert len(set(plan.slots)) == len(plan.slots), "two writes to one slot in one step"
        return plan, writes

    def _publish(self, req: Req, length: int, *, prompt_end: bool = False) -> None:
        """Publish ``req.tokens[:length]``; with ``prompt_end`` also attach the prompt's payload."""
        path = tuple(req.tokens[:length])
        table = list(req.seq.table)
        new_tokens = self.mgr.publish(req.seq, path, prompt_end=prompt_end)
        if req.seq.table != table:
            event("publish: remapped duplicates")
        if not path:
            assert new_tokens == 0
            return
        assert new_tokens == length - longest_match(path, self.paths[req.salt])
        add_path(self.paths[req.salt], path)
        req.locked_len = length
        if prompt_end:
            self.mgr.attach_payload(req.seq, payload_of(req.salt, path))
            self.payloads[(req.salt, path)] = payload_of(req.salt, path)

    def _end(self, req: Req, *, publish: bool) -> None:
        """Finish or preempt (release, publishing every token, as the engine does), or abort / fail admission
        (release only)."""
        if publish:
            path = tuple(req.tokens)
            new_tokens = self.mgr.release(req.seq, publish=path)
            if path:
                assert new_tokens == len(path) - longest_match(path, self.paths[req.salt])
                add_path(self.paths[req.salt], path)
            self._remember(req.tokens)
        else:
            assert self.mgr.release(req.seq) == 0
        del self.live[req.rid]
        assert req.seq.table == [] and req.seq.node is None

    def _evict(self, num_blocks: int) -> None:
        free, evicted = self.mgr.num_free_blocks, self.mgr.tree.counters.evicted_blocks
        freed = self.mgr.tree.evict(num_blocks)
        event(f"evict: freed {'some' if freed else 'nothing'}")
        assert self.mgr.num_free_blocks == free + freed
        assert self.mgr.tree.counters.evicted_blocks == evicted + freed
        assert freed >= num_blocks or self.mgr.tree.num_evictable_leaves == 0
        self._transfer()
        self._sync_after_eviction()

    def _evict_host(self, num_blocks: int) -> None:
        host = self.mgr.host.pool
        free = host.num_free
        freed = self.mgr.tree.tiers.evict(num_blocks)
        event(f"host evict: freed {'some' if freed else 'nothing'}")
        assert host.num_free == free + freed
        assert freed >= num_blocks or self.mgr.tree.num_host_evictable_leaves == 0
        self._sync_after_eviction()

    def _can_reset(self) -> bool:
        """Reset when nothing is live and the tree holds at least half the pool (rare enough that the tree
        gets deep between resets)."""
        return not self.live and self.mgr.num_free_blocks <= self.mgr.num_blocks // 2

    def _reset(self) -> None:
        """Invariant 6: with every request ended, a reset leaves every block free."""
        event("reset")
        self.mgr.reset()
        assert self.mgr.num_free_blocks == self.mgr.num_blocks
        if self.mgr.host is not None:
            assert self.mgr.host.pool.num_free == self.mgr.host.num_blocks
        assert self.mgr.tree.nodes() == []
        self.paths.clear()
        self.payloads.clear()

    def _sync_after_eviction(self) -> None:
        """After anything that may evict: no locked prefix was removed (invariant 5) and the tree did not
        grow; shrink the model to what is left."""
        tree = tree_paths(self.mgr)
        for req in self.live.values():
            locked = req.tokens[: req.locked_len]
            assert longest_match(locked, tree[req.salt]) == len(locked), (
                f"request {req.rid}'s locked prefix evicted"
            )
            node = req.seq.node
            if node is not None:
                assert len(path_tokens(node)) == node.end, f"locked {node} was detached"
                assert not node.host, f"locked {node} was written back to the host"
        for salt, paths in self.paths.items():
            for path in tree[salt]:
                assert longest_match(path, paths) == len(path), f"tree holds unpublished {path}"
            kept: set[tuple[int, ...]] = set()
            for path in paths:
                add_path(kept, path[: longest_match(path, tree[salt])])
            kept.discard(())
            self.paths[salt] = kept
        self.payloads = {
            key: value
            for key, value in self.payloads.items()
            if longest_match(key[1], self.paths[key[0]]) == len(key[1])
        }
