"""The in-round two-pass protocol: `needs_copy_of_unwritten` + `mark_written`.

A *round* is everything between two `mark_written` calls: one forward pass. What a round reserves is
*pending*: the model collects the round's copies and writes and applies them only at `mark_written`, all
copies first (one batched launch), then all writes, as the engine's forward does. Publishing mid-round
makes pending KV visible to later admissions of the same round (that is how a leader's prefix is shared
with the followers of its round), so a follower may need to copy a block whose slots ``[0, offset)`` are
still pending; such a copy would read garbage. `needs_copy_of_unwritten` must say so, and the driver then
defers the follower: releases it and readmits it after `mark_written`.

Beyond `CacheDriver`'s checks, after every step:

* `needs_copy_of_unwritten(seq, n)` is True exactly when `reserve` would copy pending slots (found out by
  reserving on a deep copy of the manager), and no executed plan ever copies a pending slot;
* no slot is written twice in one round (a copy's destination may be: the copies run first), and no block
  with pending writes is free (it could be handed out again and written twice within one forward);
* whenever the round has been applied, every live sequence and tree node reads back its own KV.

The engine's contract modelled here: a sequence with pending writes is not released before
`mark_written` (finish/abort wait for the round's end), a sequence reserves at most once per round, and
within a round sequences reserve one at a time (batched decode steps come after `mark_written`).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from property_tests.cache_driver import (
    MAX_LEN,
    PICK,
    PROMPT_PARTS,
    SALTS,
    TOKENS,
    CacheDriver,
    Req,
    Write,
)
from radixinfer.cache.kv_manager import SeqKV


class InRoundMachine(CacheDriver):
    host_tier = False  # the rounds' pending copies and writes are modelled without a host tier

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[int, int]] = []  # the round's block copies (src, dst)
        self.writes: list[Write] = []  # the round's K/V writes
        self.pending: set[int] = set()  # slots the round writes or copies into
        self.written: set[int] = set()  # slots the round writes (after its copies)
        self.stepped: set[int] = set()  # requests with pending writes
        self.deferred: list[
            tuple[list[int], Hashable, bool]
        ] = []  # admissions waiting for the next round

    def kv_settled(self) -> bool:
        return not self.copies and not self.writes

    # ------------------------------------------------------------------ rules
    @rule(**PROMPT_PARTS, salt=SALTS, publish=st.booleans())
    def admit(self, base: int, keep: int, suffix: list[int], salt: Hashable, publish: bool) -> None:
        self._admit_in_round(self._compose(base, keep, suffix), salt, publish)

    @rule(**PROMPT_PARTS, salt=SALTS)
    def admit_twins(self, base: int, keep: int, suffix: list[int], salt: Hashable) -> None:
        """Two requests compute the same prompt in this round before either publishes; the second publish
        finds duplicates the forward has yet to write."""
        prompt = self._compose(base, keep, suffix)
        twins = [self._admit_in_round(prompt, salt, publish=False) for _ in range(2)]
        for req in twins:
            if req is not None:
                self._publish(req, len(prompt), prompt_end=True)

    @precondition(lambda self: self._ready())
    @rule(
        picks=st.lists(PICK, min_size=1, max_size=6),
        tokens=st.lists(TOKENS, min_size=6, max_size=6),
    )
    def decode(self, picks: list[int], tokens: list[int]) -> None:
        """Sequences that have not reserved this round grow by one token each, one `reserve` per sequence
        right after its own `needs_copy_of_unwritten` (exact only for a single sequence: in one batch, a
        claim by one sequence can force its neighbour to copy); one that would copy pending KV, or finds
        memory short, sits this round out. `test_cache_machine` covers batched decode steps."""
        ready = self._ready()
        for req, token in zip(dict.fromkeys(self._pick(i, ready) for i in picks), tokens):
            if not self._must_wait(req.seq, req.seq.num_kv + 1):
                self._schedule([req], [[token]])

    @precondition(lambda self: self._ready())
    @rule(pick=PICK, tokens=st.lists(TOKENS, min_size=2, max_size=5))
    def prefill_chunk(self, pick: int, tokens: list[int]) -> None:
        """One sequence that has not reserved this round grows by several tokens (a chunk of a prompt)."""
        req = self._pick(pick, self._ready())
        if not self._must_wait(req.seq, req.seq.num_kv + len(tokens)):
            self._schedule([req], [tokens])

    @precondition(lambda self: self.live)
    @rule(pick=PICK, cut=st.integers(0, MAX_LEN))
    def publish_prefix(self, pick: int, cut: int) -> None:
        """Publish any prefix of a live sequence, pending positions included."""
        req = self._pick(pick)
        self._publish(req, min(cut, len(req.tokens)))

    @precondition(lambda self: self._idle())
    @rule(pick=PICK)
    def finish(self, pick: int) -> None:
        self._end(self._pick(pick, self._idle()), publish=True)

    @precondition(lambda self: self._idle())
    @rule(pick=PICK)
    def abort(self, pick: int) -> None:
        self._end(self._pick(pick, self._idle()), publish=False)

    @rule(num_blocks=st.integers(1, 6))
    def evict(self, num_blocks: int) -> None:
        self._evict(num_blocks)

    @rule()
    def mark_written(self) -> None:
        """End of the round: apply it, then readmit the deferred requests in the next round."""
        self._apply_round()
        deferred, self.deferred = self.deferred, []
        for prompt, salt, publish in deferred:
            self._admit_in_round(prompt, salt, publish)

    @precondition(lambda self: self._can_reset())
    @rule()
    def reset(self) -> None:
        self._apply_round()
        self._reset()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def pending_blocks_stay_held(self) -> None:
        for slot in self.pending:
            assert self.mgr.pool.refcount[slot // self.bs] > 0, (
                f"slot {slot} is pending but its block is free"
            )

    # ------------------------------------------------------------------ helpers
    def _ready(self) -> list[Req]:
        return [
            r for r in self.live.values() if r.rid not in self.stepped and len(r.tokens) < MAX_LEN
        ]

    def _idle(self) -> list[Req]:
        return [r for r in self.live.values() if r.rid not in self.stepped]

    def _admit_in_round(self, prompt: list[int], salt: Hashable, publish: bool) -> Req | None:
        """Admit and schedule the prompt; None when deferred to the next round or out of memory."""
        req = self._admit(prompt, salt)
        if self._must_wait(req.seq, len(prompt)):
            event("admit: deferred, copy source pending")
            self._end(req, publish=False)
            self.deferred.append((prompt, salt, publish))
            return None
        if not self._schedule([req], [prompt[req.seq.num_kv :]]):
            self._end(req, publish=False)  # out of memory: dropped
            return None
        if publish:
            self._publish(req, len(prompt), prompt_end=True)
        return req

    def _must_wait(self, seq: SeqKV, new_len: int) -> bool:
        """`needs_copy_of_unwritten`, checked against what `reserve` would really copy."""
        wait = self.mgr.needs_copy_of_unwritten(seq, new_len)
        would = self._would_copy_pending(seq, new_len)
        if would is not None:
            assert wait == would, (
                f"needs_copy_of_unwritten says {wait}, reserve would copy pending KV: {would}"
            )
        return wait

    def _would_copy_pending(self, seq: SeqKV, new_len: int) -> bool | None:
        """Reserve on a deep copy of the manager; None when that runs out of memory (nothing to compare)."""
        offset = seq.num_kv % self.bs
        if not any(seq.table[-1] * self.bs + o in self.pending for o in range(offset)):
            return False  # nothing it could copy is pending (offset 0 or written boundary block)
        mgr, clone = copy.deepcopy((self.mgr, seq))
        old_table = list(clone.table)
        plan = mgr.reserve([clone], [new_len])
        if plan is None:
            return None
        if not plan.copies:
            return False
        [(src, _)] = plan.copies
        assert src == old_table[-1]
        return any(src * self.bs + o in self.pending for o in range(offset))

    def _schedule(self, reqs: list[Req], new_tokens: list[list[int]]) -> bool:
        """Reserve in one call and add the plan to the round (nothing is applied before `mark_written`)."""
        before = [(list(r.seq.table), r.seq.num_kv) for r in reqs]
        reserved = self._reserve(reqs, new_tokens)
        if reserved is None:
            return False
        plan, writes = reserved
        for req, (table, num_kv) in zip(reqs, before):
            if table and req.seq.table[len(table) - 1] != table[-1]:  # copied its boundary block
                src = table[-1]
                read = {src * self.bs + o for o in range(num_kv % self.bs)}
                assert not read & self.pending, (
                    f"request {req.rid} copies block {src} before it is written"
                )
        for write in writes:
            assert write.slot not in self.written, f"slot {write.slot} written twice in one forward"
        self.copies += plan.copies
        self.writes += writes
        self.written |= {w.slot for w in writes}
        self.pending |= self.written | {
            dst * self.bs + o for _, dst in plan.copies for o in range(self.bs)
        }
        self.stepped |= {r.rid for r, tokens in zip(reqs, new_tokens) if tokens}
        return True

    def _apply_round(self) -> None:
        """The forward: the round's copies (one batched launch), then its writes."""
        self.kv.copy_blocks(self.copies)
        for write in self.writes:
            self.kv.store[write.slot] = write.value
        self.mgr.mark_written()
        self.copies, self.writes = [], []
        self.pending.clear()
        self.written.clear()
        self.stepped.clear()
        self.kv_reads_back()


TestInRoundMachine = InRoundMachine.TestCase
