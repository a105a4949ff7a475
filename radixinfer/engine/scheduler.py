"""The scheduler: which requests hold KV and run, as plain plans (docs/request-lifecycle.md).

It owns the queues (``waiting``; ``active``, with its ``prefilling`` part) and decides, on the
cache's word: a prefill round's `PrefillPlan` (admission, chunks, dedup leaders, deferral to a
second pass, the retry-as-miss fallback), the step's decode batch, and whom to preempt. The engine
runs what it plans.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections import deque

from radixinfer.cache.kv_manager import KVCacheManager, ReservePlan
from radixinfer.engine.admission import Grant, plan_admission
from radixinfer.engine.config import EngineConfig, EngineCounters
from radixinfer.engine.decode_batch import DecodeBatch
from radixinfer.engine.prefill_plan import (
    STORED,
    PrefillItem,
    PrefillPass,
    PrefillPlan,
    ReservedChunk,
)
from radixinfer.engine.request import Request, Status

# Admission leaves room for the output the requests holding KV surely produce over this many more
# decode steps (a chat answer's worth): a longer output's later growth is met by the requests that
# finish meanwhile, or by preemption, rather than by holding its whole length back from admission
# (which would keep a batch of long generations from running at once).
GROWTH_LOOKAHEAD = 256


class Planned(enum.Enum):
    """What `Scheduler._plan_item` did with a request."""

    ADMITTED = "admitted"  # it is in the pass
    DEFERRED = "deferred"  # it must wait for the pass's K/V writes: nothing held
    NO_MEMORY = "no memory"  # KV memory is short: left where it was
    LOADING = "loading"  # admitted, but it reads blocks still arriving from the host tier


class Scheduler:
    """Admission, prefill planning, the decode batch and preemption over the engine's queues.

    ``epoch`` counts changes to the set of running requests (a decode batch holds while it is
    unchanged); ``departures`` counts requests that stopped running (a launch's tokens all go to
    running requests while it is unchanged); ``held_for_loads``: the prefilling requests of the
    round being planned that wait for loads from the host tier (`plan_deferred` plans those whose
    loads completed)."""

    def __init__(self, cache: KVCacheManager, config: EngineConfig, counters: EngineCounters):
        self.cache = cache
        self.config = config
        self.counters = counters
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # PREFILLING + RUNNING, in admission order
        self.prefilling: list[Request] = []  # the PREFILLING requests of `active`, in order
        self.epoch = 0
        self.departures = 0
        self.last_decode: DecodeBatch | None = None
        self.held_for_loads: list[Request] = []
        # Requests admitted while their prefix loads -> the chunk each reserved then (`_plan_item`).
        self._held: dict[Request, ReservedChunk] = {}
        self._round = itertools.count()

    # ------------------------------------------------------------------ prefill
    def plan_prefill(self) -> PrefillPlan:
        """Admit what the policy grants into one pass, after the chunked prompts in progress (they
        hold blocks and a locked path), with at most ``max_batch_size`` penalised sequences holding
        KV at once (the sampler's token-count rows, `TokenCounts`). Requests that would copy a
        block this pass is still writing
        (they extend a prefix another request of the pass computes) are deferred to a second pass
        (`plan_deferred`, once this one's forward is issued). Requests that read blocks still being
        loaded from the host tier are admitted but wait, holding them, while the others go on."""
        admission = self.config.admission
        first = PrefillPass()
        budget = admission.max_tokens
        self.held_for_loads = []
        for req in self.prefilling:
            outcome = Planned.NO_MEMORY
            if budget > 0:
                outcome = self._plan_item(first, req, budget, False)
            if outcome is Planned.LOADING:
                continue
            if outcome is not Planned.ADMITTED:
                break
            budget -= first.items[-1].end - first.items[-1].start
        deferred: list[Grant[Request]] = []
        if not self.waiting:  # (most decode steps: nothing to admit)
            return PrefillPlan(first, deferred)
        cap = self.config.max_num_seqs
        # sequences held, counting the samples that prefilling requests will fork
        held = len(self.active) + sum([_seqs(r) - 1 for r in self.prefilling if len(r.group) > 1])
        penalized: int | None = None  # penalised sequences held, counted at the first such grant
        free_slots = admission.max_requests if cap is None else cap - held
        if free_slots > 0 and budget > 0:
            growth = self._blocks_to_finish_held()  # (a loop over the running: only to admit)
            window = max(admission.lookahead, admission.max_requests)
            grants = plan_admission(
                list(itertools.islice(self.waiting, window)), admission, next(self._round),
                cost_of=self._uncached_cost, cached_of=self._cached_len,
                max_requests=free_slots, max_tokens=budget,
            )  # fmt: skip
            for grant in grants:
                need = _seqs(grant.item)
                if cap is not None and held and held + need > cap:
                    break  # its samples would pass the cap: it waits (alone, it may pass it)
                if grant.item.params.penalized:
                    if penalized is None:
                        penalized = sum(_seqs(r) for r in self.active if self._holds_counts(r))
                    if penalized + need > self.config.max_batch_size:
                        break  # no count row for it: it waits (intake refused more alone)
                # An unchunked grant takes the whole uncached rest even where a load from the host
                # tier stops short of the match the policy costed (the rest is computed then, as
                # without the tier), so it holds no partial prompt; the budget left bounds it.
                num_tokens = grant.num_tokens if grant.chunked else max(grant.num_tokens, budget)
                outcome = self._plan_item(
                    first, grant.item, num_tokens, True, may_defer=True, growth=growth
                )
                if outcome is Planned.NO_MEMORY:
                    break  # the rest waits
                if outcome is Planned.ADMITTED:
                    budget -= first.items[-1].end - first.items[-1].start
                if outcome is not Planned.DEFERRED:
                    growth += self._blocks_to_finish(grant.item)
                held += need
                if grant.item.params.penalized:
                    penalized += need
                if outcome is Planned.DEFERRED:
                    deferred.append(grant)
        return PrefillPlan(first, deferred)

    @staticmethod
    def _holds_counts(req: Request) -> bool:
        """Whether a request of ``active`` holds (or will hold) a token-count row: penalised, and
        holding KV (a finished one not yet dropped holds none)."""
        return req.params.penalized and req.seq is not None

    def plan_deferred(self, grants: list[Grant[Request]]) -> PrefillPass:
        """The second pass of a round, planned after the first pass's forward was issued: first the
        requests held for loads that have completed since (the caller may have the device wait for
        them: `LLMEngine._prefill_round`), so they start this round rather than the next, then the
        deferred ``grants``. A request that would now copy a block the second pass itself writes
        waits for the next round."""
        second = PrefillPass()
        self._plan_loaded(second)
        growth = self._blocks_to_finish_held() if grants else 0
        for grant in grants:
            outcome = self._plan_item(
                second, grant.item, grant.num_tokens, True, may_defer=True, growth=growth
            )
            if outcome is Planned.NO_MEMORY:
                break
            if outcome is not Planned.DEFERRED:
                growth += self._blocks_to_finish(grant.item)
        return second

    def _plan_loaded(self, pass_: PrefillPass) -> None:
        """Plan into ``pass_`` the requests held for loads that have completed (each reserved its
        chunk at admission, or reads its whole prompt); the others stay held."""
        held = self.held_for_loads
        self.held_for_loads = []
        for req in held:
            self._plan_item(pass_, req, self.config.admission.max_tokens, False)

    def _uncached_cost(self, req: Request) -> int:
        tokens = req.token_array()
        return len(tokens) - self.cache.cached_prefix_len(tokens, req.salt)

    def _cached_len(self, req: Request) -> int:
        return self.cache.cached_prefix_len(req.token_array(), req.salt)

    def _plan_item(
        self,
        pass_: PrefillPass,
        req: Request,
        num_tokens: int,
        fresh: bool,
        may_defer: bool = False,
        growth: int = 0,
    ) -> Planned:
        """Admit (when ``fresh``), reserve and publish up to ``num_tokens`` prompt positions of
        ``req`` into ``pass_``. Leaves the request where it was unless it returns ``ADMITTED`` or
        ``LOADING``; ``DEFERRED`` only with ``may_defer``. A fresh admission's reservation leaves
        free the ``growth`` blocks the requests holding KV still take to finish, and those the
        request itself takes after this chunk (`_reserve_chunk`).

        ``LOADING``: admitted, nothing planned, as it reads blocks still arriving from the host
        tier. It reserves its chunk at admission all the same (all or nothing, as any admission
        does: without it, requests admitted while it waits could take the memory it needs and
        leave it stuck, holding its loaded blocks, until preemption frees some) and plans that
        chunk once the loads complete."""
        tokens = req.token_array()
        n = len(tokens)
        cache = self.cache
        if fresh:
            # prompt logprobs need the logits of every prompt position: no cached positions
            use_cache = req.prompt_logprobs is None or not req.needs_prompt_logprobs()
            takes = functools.partial(self._blocks_reserved_after, req, num_tokens, growth)
            seq = cache.admit(tokens, req.salt, use_cache=use_cache, then_takes=takes)
            end = _chunk_end(req, seq.num_kv, num_tokens)
            if may_defer and cache.needs_copy_of_unwritten(seq, end):
                cache.release(seq)
                return Planned.DEFERRED
            req.seq = seq
        seq = req.seq
        if cache.is_loading(seq):
            if fresh:
                if seq.num_kv < n:
                    chunk = self._reserve_chunk(req, num_tokens, False, growth)
                    if chunk is None:
                        return self._no_memory(req)
                    self._held[req] = chunk
                self._enter(req)
            self.held_for_loads.append(req)
            return Planned.LOADING
        start = seq.num_kv
        chunk = self._held.pop(req, None)
        if chunk is not None:  # reserved while its loads were in flight (they completed)
            cache.note_in_place_writes(*chunk.writes(seq.table, cache.block_size))
        elif start >= n:  # the whole prompt is cached
            leader = None
            if seq.payload is None:
                leader = pass_.leaders.get((req.salt, tokens.tobytes()))
            if seq.payload is not None or leader is not None:  # nothing to compute
                item = PrefillItem(req, n, n, [], payload=seq.payload, leader=leader)
            else:  # recompute the last position for fresh logits; its K/V is already stored
                item = PrefillItem(req, n - 1, n, [STORED])
        else:
            growth_of = growth if fresh else None
            chunk = self._reserve_chunk(req, num_tokens, fresh and not self.active, growth_of)
            if chunk is None:
                return self._no_memory(req) if fresh else Planned.NO_MEMORY
        if chunk is not None:
            pass_.copies.extend(chunk.copies)
            cache.publish(req.seq, tokens[: chunk.end], prompt_end=chunk.end == n)
            item = PrefillItem(req, chunk.start, chunk.end, chunk.slots)
            if chunk.end == n:
                pass_.leaders.setdefault((req.salt, tokens.tobytes()), item)
        pass_.items.append(item)
        if req.num_cached_tokens is None:  # its first admission planned
            cached = item.start if item.computes else n
            self.counters.count_admission(req, cached, min(req.seq.num_loaded, cached))
        if fresh:
            self._enter(req)
        return Planned.ADMITTED

    def _blocks_reserved_after(
        self, req: Request, num_tokens: int, growth: int, length: int
    ) -> int:
        """The GPU blocks a fresh admission of ``req`` for ``num_tokens`` positions reserves once
        its match ends at ``length`` (`_reserve_chunk`: the chunk's blocks, and those it leaves
        free): what `KVCacheManager.admit` makes room for beside each host-resident node it loads,
        so a prefix is loaded only for a request admitted in the same step. A match that ends
        inside a block ends in a loaded block filled up to it, which the chunk writes on in place."""
        if length >= req.num_tokens:
            return 0  # the whole prompt is read: nothing is reserved
        bs = self.cache.block_size
        end = _chunk_end(req, length, num_tokens)
        return -(-end // bs) - -(-length // bs) + self._kept_free(req, end, growth)

    def _kept_free(self, req: Request, end: int, growth: int | None) -> int:
        """The free blocks an admission's reservation of ``req`` up to position ``end`` leaves: the
        ``growth`` blocks the requests holding KV still take to finish, and those ``req`` takes
        after ``end`` (None, or nothing else holding KV: none, as it then runs alone)."""
        if growth is None or not self.active:
            return 0
        return growth + self._blocks_to_finish(req, end)

    def _reserve_chunk(
        self, req: Request, num_tokens: int, may_retry: bool, growth: int | None = None
    ) -> ReservedChunk | None:
        """Reserve ``req``'s next ``num_tokens`` prompt positions (at least one), or None when
        memory is short. ``growth`` (an admission): the blocks the requests holding KV still take
        to finish; the reservation leaves them free, and those ``req`` takes after the chunk, so
        admitting it preempts nobody later (but when nothing else holds KV: it runs alone then,
        and preemption is what frees memory for it). ``may_retry``: a fresh admission while
        nothing else holds KV, so only the request's own locked hit can be in the way (ancestors
        along its path hold older versions of boundary blocks it does not read): it is admitted
        again as a miss, which fits the pool once everything unlocked is evicted (`add_request`
        checked that), and computes from the start up to the end planned for the hit."""
        cache, seq = self.cache, req.seq
        start = seq.num_kv
        end = _chunk_end(req, start, num_tokens)
        plan = cache.reserve([seq], [end], self._kept_free(req, end, growth))
        if plan is None and may_retry:
            cache.release(seq)
            req.seq = seq = cache.admit(req.token_array(), req.salt, use_cache=False)
            start = 0
            plan = cache.reserve([seq], [end])
            assert plan is not None, "a request that fits the empty pool did not fit it"
        return None if plan is None else ReservedChunk(start, end, plan.slots, plan.copies)

    def _blocks_to_finish_held(self) -> int:
        """The blocks the requests holding KV will surely take still (`_blocks_to_finish`)."""
        return sum([self._blocks_to_finish(r) for r in self.active if r.seq is not None])

    def _blocks_to_finish(self, req: Request, held_positions: int | None = None) -> int:
        """The blocks ``req`` will surely take still, beyond those of its first ``held_positions``
        positions (None: its block table): for its prompt and the positions of the output it
        surely reaches (`_sure_output_len`; the last token is never fed back) within
        `GROWTH_LOOKAHEAD` more tokens, once for each sequence it holds (samples waiting to fork
        it grow apart)."""
        bs = self.cache.block_size
        end = len(req.prompt_ids) + _sure_output_len(req)
        final = -(-(min(end, req.num_tokens + GROWTH_LOOKAHEAD) - 1) // bs)
        held = len(req.seq.table) if held_positions is None else -(-held_positions // bs)
        return max(0, final - held) * _seqs(req)

    def _no_memory(self, req: Request) -> Planned:
        """A fresh admission found memory short: it gives back what it holds and waits."""
        self.cache.release(req.seq)
        req.seq = None
        return Planned.NO_MEMORY

    def _enter(self, req: Request) -> None:
        """Move an admitted request from ``waiting`` to ``active``, prefilling."""
        self.waiting.remove(req)
        self.active.append(req)
        self.prefilling.append(req)
        req.status = Status.PREFILLING

    def start_running(self, reqs: list[Request]) -> None:
        """These requests' prompts are complete: they decode from their first token on."""
        for req in reqs:
            req.status = Status.RUNNING
        self.prefilling = [r for r in self.prefilling if r.status is Status.PREFILLING]
        self.epoch += 1

    def fork(self, first: Request) -> list[Request]:
        """``first``'s prompt is complete: its group's samples waiting for it share its KV
        (`KVCacheManager.fork`) and join ``active`` after it, their prompt complete. Their prompt
        was computed (or read from the cache) once, for ``first``: they count none of it again.
        Returns them, in sample order (none for a request of one sample)."""
        samples = [r for r in first.group if r.status is Status.FORKING]
        for req in samples:
            req.seq = self.cache.fork(first.seq)
            req.prompt_done = first.prompt_done
            req.num_cached_tokens = first.num_cached_tokens
            req.num_computed_prompt_tokens = first.num_computed_prompt_tokens
            self.active.append(req)
        return samples

    # ------------------------------------------------------------------ decode
    def decode_batch(self) -> tuple[DecodeBatch | None, bool]:
        """This step's batch, and whether it is the last step's: running requests with room for one
        more token, oldest first, at most ``max_batch_size``. Without a pass over the requests while
        the running set is unchanged and every member has room (the steady state)."""
        last = self.last_decode
        if last is not None and last.epoch == self.epoch and last.left.min() > 0:
            return last, True
        running = Status.RUNNING
        reqs = [r for r in self.active if r.status is running and r.num_sampled < r.max_output_len]
        del reqs[self.config.max_batch_size :]  # the rest wait for a slot
        if last is not None and reqs == last.reqs:  # the running set changed outside the batch
            last.epoch = self.epoch
            return last, True
        return (DecodeBatch.build(reqs, self.epoch) if reqs else None), False

    def preempt_until_reserved(self) -> tuple[DecodeBatch | None, ReservePlan | None]:
        """Preempt the newest requests until the decode batch fits (every token read back first):
        ``(batch, its reserve plan)``, or ``(None, None)`` when nothing is left to decode."""
        while True:
            batch, _ = self.decode_batch()
            if batch is None:
                return None, None
            plan = self.cache.reserve_step(batch.lanes)
            if plan is not None:
                return batch, plan
            self.preempt_newest()

    # ------------------------------------------------------------------ leaving
    def preempt_newest(self) -> None:
        """Free the newest request's blocks under memory pressure; its computed prefix stays in the
        tree, so its recompute is a cache hit. It resumes from the front of the queue with its
        output so far."""
        req = max(self.active, key=lambda r: r.arrival_index)
        self.leave(req)
        self._departed()
        req.status = Status.WAITING
        req.prompt_done = 0
        self.counters.count_preemption(req)
        self.waiting.appendleft(req)

    def leave(self, req: Request) -> None:
        """Take a request that holds KV out of ``active`` and release its blocks (the caller then
        retires or requeues it)."""
        if req.status is Status.PREFILLING:
            self.prefilling.remove(req)
        self.active.remove(req)
        self.release(req)

    def release(self, req: Request) -> None:
        """Publish what the request computed (prompt and generated tokens; not a chunk it holds
        for its loads) and drop its blocks."""
        seq = req.seq
        if seq is None:
            return
        chunk = self._held.pop(req, None)
        computed = seq.num_kv if chunk is None else chunk.start
        self.cache.release(seq, publish=req.token_array()[:computed])
        req.seq = None

    def retire(self, req: Request, reason: str) -> None:
        """Mark a request finished (its blocks are released already; a finished running request is
        dropped from ``active`` by `drop_finished`)."""
        if req.status is Status.PREFILLING or req.status is Status.RUNNING:
            self._departed()
        req.status = Status.FINISHED
        req.finish_reason = reason

    def _departed(self) -> None:
        self.epoch += 1
        self.departures += 1

    def drop_finished(self) -> None:
        """Drop finished requests from ``active`` in one pass (a whole batch may finish at once)."""
        self.active = [r for r in self.active if r.status is not Status.FINISHED]


def _chunk_end(req: Request, start: int, num_tokens: int) -> int:
    """Where a prompt chunk of up to ``num_tokens`` positions (at least one) from ``start`` ends."""
    return min(req.num_tokens, start + max(num_tokens, 1))


def _seqs(req: Request) -> int:
    """The sequences a request holds once running: itself, and the samples waiting to fork it."""
    group = req.group
    return 1 if len(group) == 1 else 1 + sum([r.status is Status.FORKING for r in group])


def _sure_output_len(req: Request) -> int:
    """The output length ``req`` reaches unless aborted: ``max_output_len`` when only the length
    can stop it (no stop token or string, EOS ignored), else ``min_tokens`` (stops count only
    after those)."""
    if not req.stop_ids and req.stop_strings is None:
        return req.max_output_len
    return min(req.params.min_tokens, req.max_output_len)
