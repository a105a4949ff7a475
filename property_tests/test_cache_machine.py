"""Random interleavings of the request lifecycle against the KV cache manager, checking the invariants
of docs/invariants.md after every step.

The machine admits requests (match + lock, then `reserve` of the prompt), grows several live
sequences by one token in ONE batched `reserve` call (a decode step) or one sequence by a few (a
prompt chunk), forks a live sequence (another sample of its prompt), publishes prompts (with
``prompt_end`` and a payload) and any prefix of a sequence's tokens, finishes (publish + release),
aborts (release only), evicts, and resets the tree when nothing is live. Requests carry one of three
cache salts; tokens come from ``{0, 1, 2}`` so prefixes collide constantly. When `reserve` returns
None, an admission is dropped and a decode step preempts the newest request (publishing its computed
prefix: docs/request-lifecycle.md, Finish, abort, preempt) and retries, as the engine does.

Each plan is applied to the fake KV store at once, copies first, then writes, and followed by
`mark_written` (one forward per step; `test_in_round_machine` covers several plans per forward);
`CacheDriver` holds the model and the checks.
"""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from property_tests.cache_driver import MAX_LEN, PICK, PROMPT_PARTS, SALTS, TOKENS, CacheDriver, Req


class CacheMachine(CacheDriver):
    @rule(**PROMPT_PARTS, salt=SALTS, publish=st.booleans())
    def admit(self, base: int, keep: int, suffix: list[int], salt: Hashable, publish: bool) -> None:
        """Admit, reserve the uncached part of the prompt, and optionally publish it with its payload."""
        prompt = self._compose(base, keep, suffix)
        req = self._admit(prompt, salt)
        if not self._grow([req], [prompt[req.seq.num_kv :]]):
            self._end(req, publish=False)  # not admitted: the engine would retry later
        elif publish:
            self._publish(req, len(prompt), prompt_end=True)

    @rule(**PROMPT_PARTS, salt=SALTS)
    def admit_twins(self, base: int, keep: int, suffix: list[int], salt: Hashable) -> None:
        """Two requests compute the same prompt before either publishes; the second publish remaps its full
        blocks onto the first's and frees its own (invariant 7)."""
        prompt = self._compose(base, keep, suffix)
        twins = []
        for _ in range(2):
            req = self._admit(prompt, salt)
            if not self._grow([req], [prompt[req.seq.num_kv :]]):
                self._end(req, publish=False)
                break
            twins.append(req)
        for req in twins:
            self._publish(req, len(prompt), prompt_end=True)

    @precondition(lambda self: self._growable())
    @rule(
        picks=st.lists(PICK, min_size=1, max_size=6),
        tokens=st.lists(TOKENS, min_size=6, max_size=6),
        lanes=st.booleans(),
    )
    def decode(self, picks: list[int], tokens: list[int], lanes: bool) -> None:
        """One decode step: several sequences grow by one token in a single `reserve` call, or in one
        `reserve_step` (``lanes``: the engine's path for a batch it decodes again)."""
        growable = self._growable()
        batch = list(dict.fromkeys(self._pick(i, growable) for i in picks))
        new_token = {r.rid: tokens[i] for i, r in enumerate(batch)}
        while batch and not self._grow(batch, [[new_token[r.rid]] for r in batch], lanes):
            victim = max(self.live.values(), key=lambda r: r.rid)  # preempt the newest request
            self._end(victim, publish=True)
            batch = [r for r in batch if r is not victim]

    @precondition(lambda self: self._growable())
    @rule(pick=PICK, tokens=st.lists(TOKENS, min_size=2, max_size=5))
    def prefill_chunk(self, pick: int, tokens: list[int]) -> None:
        """One sequence grows by several tokens in one `reserve` (a chunk of a long prompt)."""
        req = self._pick(pick, self._growable())
        self._grow([req], [tokens])

    @precondition(lambda self: self.live)
    @rule(pick=PICK, cut=st.integers(0, MAX_LEN))
    def publish_prefix(self, pick: int, cut: int) -> None:
        """Publish any prefix of a live sequence's tokens (generated ones included; it may be shorter than
        what the sequence published before, which moves its lock up the tree)."""
        req = self._pick(pick)
        self._publish(req, min(cut, len(req.tokens)))

    @precondition(lambda self: self.live)
    @rule(pick=PICK)
    def fork(self, pick: int) -> None:
        """Another sample of a live sequence (a request of n > 1 completions): it shares every block
        and the lock; the next write of each into their shared boundary block obeys copy-on-write."""
        req = self._pick(pick)
        twin = Req(
            next(self.rids), self.mgr.fork(req.seq), req.salt, list(req.tokens), req.locked_len
        )
        self.live[twin.rid] = twin

    @precondition(lambda self: self.live)
    @rule(pick=PICK)
    def finish(self, pick: int) -> None:
        self._end(self._pick(pick), publish=True)

    @precondition(lambda self: self.live)
    @rule(pick=PICK)
    def abort(self, pick: int) -> None:
        self._end(self._pick(pick), publish=False)

    @rule(num_blocks=st.integers(1, 6))
    def evict(self, num_blocks: int) -> None:
        """GPU eviction: with a host tier, LRU tails are written back to the host (offload)."""
        self._evict(num_blocks)

    @precondition(lambda self: self.mgr.host is not None)
    @rule(num_blocks=st.integers(1, 4))
    def evict_host(self, num_blocks: int) -> None:
        """The host tier's own eviction: host-resident LRU leaves are dropped from their tails."""
        self._evict_host(num_blocks)

    @precondition(lambda self: self._can_reset())
    @rule()
    def reset(self) -> None:
        self._reset()

    def _growable(self) -> list[Req]:
        return [r for r in self.live.values() if len(r.tokens) < MAX_LEN]

    def _grow(self, reqs: list[Req], new_tokens: list[list[int]], lanes: bool = False) -> bool:
        """Reserve and run the step's forward right away: its copies first, then its writes."""
        reserved = self._reserve(reqs, new_tokens, lanes)
        if reserved is None:
            return False
        plan, writes = reserved
        self.kv.copy_blocks(plan.copies)
        for write in writes:
            self.kv.store[write.slot] = write.value
        self.mgr.mark_written()
        return True


TestCacheMachine = CacheMachine.TestCase
