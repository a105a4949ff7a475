"""The online engine: continuous batching over the prefix cache (docs/request-lifecycle.md).

``add_request`` / ``abort`` / ``step`` are meant to be driven by one thread (the `LLM` API or the streaming
loop). Each ``step`` runs one prefill round (admission + one ragged forward, plus at most one more pass for
requests that must copy a block the first pass is writing) and one batched decode step, in the order
``decode_first`` asks for.

No forward is waited for in the step that launches it. Sampled tokens stay on the device; the next step's
decode takes them from there, and the host reads them back (to stream, stop, finish) only after launching
that next step's forwards. So the host plans and launches step k+1 while the GPU still runs step k, and a
token reaches the caller one step after it is sampled.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixinfer.cache.kv_manager import DecodeLanes, KVCacheManager, ReservePlan
from radixinfer.engine.admission import AdmissionConfig, Grant, plan_admission
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.engine.prompts import PromptChecker
from radixinfer.engine.request import Request, Status
from radixinfer.engine.sampler import SamplingBatch, sample
from radixinfer.outputs import EngineEvent, StreamDelta, TokenBatch
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 64  # sequences decoded in one step
    # Requests holding KV at once (prefilled + decoding). None: bounded only by KV memory and the per-round
    # prefill batch, so a request's first token never waits for a decode slot (its later ones may).
    max_num_seqs: int | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    decode_first: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")


@dataclass
class EngineCounters:
    """Engine counters. Taken at a request's successful admission, never at a failed attempt, so once no
    prompt is part-way through prefill ``prompt_tokens == cached_tokens + computed_prompt_tokens`` (a prompt
    aborted part-way counts only what was read or computed; one preempted before its first token counts afresh
    at its next admission)."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests (counted once per request)
    cached_tokens: int = 0  # of those, read from the prefix cache (`Request.num_cached_tokens`)
    computed_prompt_tokens: int = 0  # of those, run through prefill forwards
    recomputed_tokens: int = (
        0  # rows computed again after a preemption (prompt and generated tokens)
    )
    prefill_forwards: int = 0
    decode_forwards: int = 0
    preemptions: int = 0


@dataclass
class _PrefillItem:
    """One request's share of a prefill pass: positions ``[start, end)`` computed (``slots`` per position,
    -1 = already stored), or nothing computed when the first token comes from ``payload`` / ``leader``."""

    req: Request
    start: int
    end: int
    slots: list[int]
    payload: Any = None
    leader: _PrefillItem | None = None
    row: int = -1  # row of this item's last computed position in the pass's hidden states


@dataclass
class _Pass:
    """One prefill forward being planned: its items, the block copies to run before it, and the first item
    computing each full prompt (identical prompts of the pass take their first token from its row)."""

    items: list[_PrefillItem] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    leaders: dict[tuple[Hashable, bytes], _PrefillItem] = field(
        default_factory=dict
    )  # (salt, prompt bytes)


@dataclass
class _DecodeBatch:
    """A decode batch, built once and decoded again for as long as it stays the same: the same requests in
    the same order, each with room for one more token (no request started or stopped running: the engine's
    ``_epoch`` is the one it was built at, and ``left`` > 0 everywhere). Each step then grows every sequence
    by exactly one position and decodes the token its last launch sampled, so nothing on the step's path walks the
    requests: lengths and boundary blocks live in ``lanes``, the tables are the sequences' own lists, and what
    the sampler and the read-back need of the members is gathered here once.

    A running sequence's table is edited only by the decode step's `reserve_step`, which says which ones
    (publishing and releasing happen before a request runs and once it stops), so the runner compares no
    other table: neither while the batch repeats nor when it changes."""

    reqs: list[Request]
    lanes: DecodeLanes
    tables: list[list[int]]
    epoch: int
    left: np.ndarray  # [n] tokens each member may still sample
    greedy: bool  # every member samples greedily
    ids_only: bool  # no member detokenizes
    stop_ids: np.ndarray  # every member's stop token ids, pooled
    request_ids: list[str]
    num_cached_tokens: list[int]
    tokens: torch.Tensor | None = (
        None  # the last launch's sampled tokens, on the device: the next inputs
    )


class _Launch:
    """One forward's sampled tokens ``[len(reqs)]``: on the device, and on their way to pinned host memory
    without blocking. The engine reads them a step later, once the GPU has newer work queued behind them.

    A decode launch knows its ``batch``, the engine's departure count when it launched, and the rows whose
    token is their last by length (``last_rows``). If no request stopped running since, its read-back decides
    per request only for those rows and the stop tokens: every other row goes out in one `TokenBatch`."""

    def __init__(
        self,
        reqs: list[Request],
        tokens: torch.Tensor,
        batch: _DecodeBatch | None = None,
        departures: int = -1,
    ) -> None:
        self.reqs, self.tokens = reqs, tokens
        self.batch, self.departures = batch, departures
        self.last_rows = np.flatnonzero(batch.left == 1) if batch is not None else _NO_ROWS
        self.read_back = False
        self.host, self.done = tokens, None
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        self.read_back = True
        return self.host.tolist()


_DEFER = object()  # `_plan_item`: must wait for the current pass's K/V writes
_NO_ROWS = np.zeros(0, dtype=np.int64)


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        cache: KVCacheManager,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        config: EngineConfig,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.config = config
        self.vocab_size = runner.model.vocab_size
        self.max_context_len = runner.max_context_len  # the model's, or max_model_len when lower
        self.prompts = PromptChecker(tokenizer, self.vocab_size, self.max_context_len)
        self.counters = EngineCounters()
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # PREFILLING + RUNNING, in admission order
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._round = itertools.count()
        self._seeds = random.Random(
            config.seed
        )  # per-request sampling seeds when params.seed is None
        self._unread: list[
            _Launch
        ] = []  # forwards launched this step, their tokens not read back yet
        self._last_decode: _DecodeBatch | None = None
        self.prefilling: list[
            Request
        ] = []  # the PREFILLING requests of `active`, in admission order
        # Counts of the changes to the set of RUNNING requests (a decode batch holds while the first is
        # unchanged), and of requests that stopped running (a launch's tokens all go to running requests
        # while the second is unchanged).
        self._epoch = 0
        self._departures = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and enqueue. Raises ``ValueError`` naming the bad field; nothing is allocated then.

        ``cache_salt``: None, or a non-empty string (vLLM's rule); requests with different salts never
        share cached KV."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            got = "an empty string" if isinstance(cache_salt, str) else type(cache_salt).__name__
            raise ValueError(f"cache_salt must be a non-empty string or None, got {got}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(
                f"request_id must be a string or None, got {type(request_id).__name__}"
            )
        prompt_array = self.prompt_ids(prompt)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            bad = max(params.stop_token_ids)
            raise ValueError(
                f"stop_token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        prompt_len = len(prompt_array)
        total = min(prompt_len + params.max_tokens, self.max_context_len)
        blocks = -(-total // self.cache.block_size) + 1  # +1: a copy-on-write of the boundary block
        if blocks > self.cache.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{blocks} KV blocks, more than the whole pool ({self.cache.num_blocks})"
            )
        arrival = next(self._arrivals)
        if request_id is None:
            request_id = str(arrival)
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(31)
        stop_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        req = Request(
            request_id=request_id,
            prompt_ids=prompt_array,
            params=params,
            salt=cache_salt,
            seed=seed,
            arrival_index=arrival,
            detokenizer=IncrementalDetokenizer(self.tokenizer) if params.detokenize else None,
            arrival_time=time.perf_counter(),
            stop_ids=stop_ids,
            max_output_len=min(params.max_tokens, self.max_context_len - prompt_len),
        )
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def prompt_ids(self, prompt: str | list[int] | np.ndarray) -> np.ndarray:
        """The prompt's token ids, checked (`PromptChecker.token_ids`). Raises ``ValueError``."""
        return self.prompts.token_ids(prompt)

    def abort(self, request_id: str) -> StreamDelta | None:
        """Stop a request wherever it is; its blocks are released at once. Returns its final delta."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            if req.status is Status.PREFILLING:
                self.prefilling.remove(req)
                # Its prompt never completes: count only the part that was read from the cache or computed.
                self.counters.prompt_tokens -= (
                    len(req.prompt_ids) - req.num_cached_tokens - req.num_computed_prompt_tokens
                )
            self.active.remove(req)
            self._release(req)
        return self._finish(req, "abort", [])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active or self._unread)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineEvent]:
        """Launch this step's forwards, then read back and emit the tokens the previous step launched: the
        host never waits for the forward it just launched, so its work overlaps the GPU's.

        Returns the step's events in order: a `StreamDelta` per request with news, except that a steady decode
        step's tokens come as one `TokenBatch` (see `radixinfer.outputs.deltas_of` for deltas only)."""
        events: list[EngineEvent] = []
        previous, self._unread = self._unread, []
        if self.config.decode_first:
            decoded = self._decode(previous, events)
            prefilled = self._prefill_round(events)
        else:
            prefilled = self._prefill_round(events)
            decoded = self._decode(previous, events)
        if not (prefilled or decoded or previous) and self.active:
            # Chunked prompts hold the memory that each of them needs to go on, and nothing runs that could
            # free some: preempt the newest (its computed prefix stays cached), so the oldest always proceeds.
            self._preempt(max(self.active, key=lambda r: r.arrival_index))
        return events

    # ------------------------------------------------------------------ prefill
    def _prefill_round(self, events: list[EngineEvent]) -> bool:
        """Admit what the policy grants and run it as one ragged forward. Requests that would copy a block
        this forward is still writing (they extend a prefix another request of the round computes) run in
        a second pass right after it. Returns whether anything was prefilled."""
        admission = self.config.admission
        first = _Pass()
        # Chunked prompts in progress continue first: they hold blocks and a locked path.
        budget = admission.max_tokens
        for req in self.prefilling:
            if budget <= 0 or not self._plan_item(first, req, budget, fresh=False):
                break
            budget -= first.items[-1].end - first.items[-1].start
        deferred: list[Grant[Request]] = []
        cap = self.config.max_num_seqs
        free_slots = admission.max_requests if cap is None else cap - len(self.active)
        if self.waiting and free_slots > 0 and budget > 0:
            candidates = list(
                itertools.islice(self.waiting, max(admission.lookahead, admission.max_requests))
            )
            for grant in plan_admission(
                candidates,
                admission,
                next(self._round),
                cost_of=self._uncached_cost,
                cached_of=self._cached_len,
                max_requests=free_slots,
                max_tokens=budget,
            ):
                outcome = self._plan_item(
                    first, grant.item, grant.num_tokens, fresh=True, may_defer=True
                )
                if outcome is _DEFER:
                    deferred.append(grant)
                elif not outcome:
                    break  # KV memory is short: the rest waits
        self._run_prefill_pass(first, events)
        if deferred:
            # A request that would now copy a block the second pass itself writes waits for the next round.
            second = _Pass()
            for grant in deferred:
                if not self._plan_item(
                    second, grant.item, grant.num_tokens, fresh=True, may_defer=True
                ):
                    break
            self._run_prefill_pass(second, events)
        return bool(first.items)

    def _uncached_cost(self, req: Request) -> int:
        return req.num_tokens - self._cached_len(req)

    def _cached_len(self, req: Request) -> int:
        return self.cache.cached_prefix_len(req.token_array(), req.salt)

    def _plan_item(
        self, pass_: _Pass, req: Request, num_tokens: int, fresh: bool, may_defer: bool = False
    ) -> bool | object:
        """Admit (when ``fresh``), reserve and publish up to ``num_tokens`` prompt positions of ``req`` into
        ``pass_``. Returns False, leaving the request where it was, when KV memory is short, and `_DEFER` when
        it must wait for this pass's writes (``may_defer``)."""
        tokens = req.token_array()
        n = len(tokens)
        if fresh:
            seq = self.cache.admit(tokens, req.salt)
            end = min(n, seq.num_kv + max(num_tokens, 1))
            if may_defer and self.cache.needs_copy_of_unwritten(seq, end):
                self.cache.release(seq)
                return _DEFER
            req.seq = seq
        seq = req.seq
        start = seq.num_kv
        if start >= n:  # the whole prompt is cached
            leader = (
                None if seq.payload is not None else pass_.leaders.get((req.salt, tokens.tobytes()))
            )
            if seq.payload is not None or leader is not None:  # nothing to compute
                item = _PrefillItem(req, n, n, [], payload=seq.payload, leader=leader)
            else:  # recompute the last position for fresh logits; its K/V is already stored
                item = _PrefillItem(req, n - 1, n, [-1])
        else:
            end = min(n, start + max(num_tokens, 1))
            plan = self.cache.reserve([seq], [end])
            if plan is None and fresh and not self.active:
                # Nothing else holds KV, so only the request's own locked hit can be in the way (ancestors
                # along its path hold older versions of boundary blocks it does not read): retry as a miss,
                # which fits the pool once everything unlocked is evicted (`add_request` checked that).
                self.cache.release(seq)
                req.seq = seq = self.cache.admit(tokens, req.salt, use_cache=False)
                start = 0  # computes from the start up to the end planned for the hit
                plan = self.cache.reserve([seq], [end])
                assert plan is not None, "a request that fits the empty pool did not fit it"
            if plan is None:
                if fresh:
                    self.cache.release(seq)
                    req.seq = None
                return False
            pass_.copies.extend(plan.copies)
            self.cache.publish(seq, tokens[:end], prompt_end=end == n)
            item = _PrefillItem(req, start, end, plan.slots)
            if end == n:
                pass_.leaders.setdefault((req.salt, tokens.tobytes()), item)
        pass_.items.append(item)
        if fresh:
            if (
                req.num_cached_tokens is None
            ):  # its first admission: what it reads from the cache is final
                req.num_cached_tokens = item.start if item.end > item.start else n
                self.counters.prompt_tokens += len(req.prompt_ids)
                self.counters.cached_tokens += req.num_cached_tokens
            self.waiting.remove(req)
            self.active.append(req)
            self.prefilling.append(req)
            req.status = Status.PREFILLING
        return True

    def _run_prefill_pass(self, pass_: _Pass, events: list[EngineEvent]) -> None:
        items = pass_.items
        if not items:
            return
        self.runner.kv.copy_blocks(pass_.copies)
        computed = [it for it in items if it.end > it.start]
        hidden = None
        if computed:
            lengths = np.fromiter(
                (it.end - it.start for it in computed), dtype=np.int64, count=len(computed)
            )
            ends = np.cumsum(lengths)
            for it, end in zip(computed, ends.tolist()):
                it.row = end - 1
            # a row's position: the row plus (its item's start - its item's first row)
            starts = np.fromiter((it.start for it in computed), dtype=np.int64, count=len(computed))
            positions = np.arange(int(ends[-1])) + np.repeat(starts - (ends - lengths), lengths)
            input_ids = np.concatenate([it.req.token_array()[it.start : it.end] for it in computed])
            slots = list(itertools.chain.from_iterable(it.slots for it in computed))
            hidden = self.runner.prefill(
                input_ids,
                positions,
                slots,
                [it.req.seq.table for it in computed],
                [it.end for it in computed],
                [it.end - it.start for it in computed],
            )
            self.cache.mark_written()
            self.counters.prefill_forwards += 1
            for it in computed:
                rows = it.end - it.start
                if (
                    it.req.num_sampled
                ):  # resumed after a preemption: its prompt was counted once already
                    self.counters.recomputed_tokens += rows
                else:
                    it.req.num_computed_prompt_tokens += rows
                    self.counters.computed_prompt_tokens += rows
        finishing = [it for it in items if it.end == it.req.num_tokens]
        for it in items:
            it.req.prompt_done = it.end
        if not finishing:
            return
        rows = []
        for it in finishing:
            if it.payload is not None:
                rows.append(it.payload[None])
            else:
                source = it.leader if it.leader is not None else it
                rows.append(hidden[source.row : source.row + 1])
        last_hidden = torch.cat(rows)  # [len(finishing), hidden]
        if self.cache.enable_prefix_cache:
            for i, it in enumerate(finishing):
                if it.payload is None and it.leader is None:
                    self.cache.attach_payload(it.req.seq, last_hidden[i])
        reqs = [it.req for it in finishing]
        for req in reqs:
            req.status = (
                Status.RUNNING
            )  # decodes from its first token, on the device until read back
        self.prefilling = [r for r in self.prefilling if r.status is Status.PREFILLING]
        self._epoch += 1
        self._launch(reqs, self._sample(reqs, self.runner.logits(last_hidden)))

    # ------------------------------------------------------------------ decode
    def _decode(self, previous: list[_Launch], events: list[EngineEvent]) -> bool:
        """Launch this step's decode, then read back ``previous`` (the launches of the step before) while
        the GPU runs it. Returns whether a decode step ran.

        A request whose newest token is still on the device decodes it from there: the host sees tokens one
        step late. A request that turns out to have stopped on such a token was decoded once more for
        nothing; its extra K/V is for a real position of its path (the stop token's), so it stays valid.
        """
        batch, repeated = self._decode_batch()
        plan = self.cache.reserve_step(batch.lanes) if batch is not None else None
        if batch is not None and plan is None:
            # Preemption publishes each victim's tokens: read back every launch first.
            self._read_back(previous + self._unread, events)
            previous, self._unread, repeated = [], [], False
            batch, plan = self._preempt_until_reserved()
        self._last_decode = batch
        if batch is not None:
            self.runner.kv.copy_blocks(plan.copies)
            lanes = batch.lanes
            if repeated:  # every input token is in the last launch, row for row
                input_ids, carried, carried_rows = (
                    np.zeros(len(batch.reqs), np.int64),
                    batch.tokens,
                    None,
                )
            else:
                input_ids, carried, carried_rows = self._decode_inputs(batch.reqs)
            logits = self.runner.decode(
                input_ids,
                lanes.num_kv - 1,
                plan.slots,
                batch.tables,
                lanes.num_kv,
                carried=carried,
                carried_rows=carried_rows,
                changed_tables=plan.changed,
            )
            self.cache.mark_written()
            self.counters.decode_forwards += 1
            batch.tokens = self._launch(
                batch.reqs, self._sample(batch.reqs, logits, batch.greedy), batch
            ).tokens
            batch.left -= 1
        self._read_back(previous, events)
        return batch is not None

    def _decode_batch(self) -> tuple[_DecodeBatch | None, bool]:
        """This step's batch, and whether it is the last step's: running requests with room for one more
        token, oldest first, at most ``max_batch_size``. Without a pass over the requests while the running
        set is unchanged and every member has room (the steady state)."""
        last = self._last_decode
        if last is not None and last.epoch == self._epoch and last.left.min() > 0:
            return last, True
        running = Status.RUNNING
        reqs = [r for r in self.active if r.status is running and r.num_sampled < r.max_output_len]
        del reqs[self.config.max_batch_size :]  # the rest wait for a slot
        if last is not None and reqs == last.reqs:  # the running set changed outside the batch
            last.epoch = self._epoch
            return last, True
        return self._new_decode_batch(reqs), False

    def _new_decode_batch(self, reqs: list[Request]) -> _DecodeBatch | None:
        if not reqs:
            return None
        seqs = [r.seq for r in reqs]
        stop_ids = frozenset().union(*(r.stop_ids for r in reqs))
        return _DecodeBatch(
            reqs,
            DecodeLanes(seqs),
            [seq.table for seq in seqs],
            self._epoch,
            left=np.fromiter(
                (r.max_output_len - r.num_sampled for r in reqs), dtype=np.int64, count=len(reqs)
            ),
            greedy=not any(r.params.temperature for r in reqs),
            ids_only=all(r.detokenizer is None for r in reqs),
            stop_ids=np.fromiter(stop_ids, dtype=np.int64, count=len(stop_ids)),
            request_ids=[r.request_id for r in reqs],
            num_cached_tokens=[r.num_cached_tokens for r in reqs],
        )

    @staticmethod
    def _decode_inputs(
        batch: list[Request],
    ) -> tuple[np.ndarray, torch.Tensor | None, list[int] | None]:
        """``(input_ids, carried, carried_rows)`` for `ModelRunner.decode`, in one pass over the batch. A
        sequence's input token is its id when read back (carried row -1), else a placeholder id and its row in
        the concatenated tokens of the launches that sampled them (the last decode, this step's prefill)."""
        offsets: dict[_Launch, int] = {}
        total = 0
        input_ids, rows = [], []
        for req in batch:
            launch = req.carry
            if launch.read_back:
                input_ids.append(req.output_ids[-1])
                rows.append(-1)
                continue
            offset = offsets.get(launch)
            if offset is None:
                offset = offsets[launch] = total
                total += len(launch.reqs)
            input_ids.append(0)
            rows.append(offset + req.carry_row)
        input_ids = np.asarray(input_ids, dtype=np.int64)
        if not offsets:
            return input_ids, None, None
        tokens = [launch.tokens for launch in offsets]
        return input_ids, tokens[0] if len(tokens) == 1 else torch.cat(tokens), rows

    def _preempt_until_reserved(self) -> tuple[_DecodeBatch | None, ReservePlan | None]:
        """Preempt the newest requests until the decode batch fits (every token read back); (batch, plan)."""
        while True:
            batch, _ = self._decode_batch()
            if batch is None:
                return None, None
            plan = self.cache.reserve_step(batch.lanes)
            if plan is not None:
                return batch, plan
            self._preempt(max(self.active, key=lambda r: r.arrival_index))

    def _launch(
        self, reqs: list[Request], tokens: torch.Tensor, batch: _DecodeBatch | None = None
    ) -> _Launch:
        """Record that ``tokens`` (sampled on the device, one per request) will be read back next step."""
        launch = _Launch(reqs, tokens, batch, self._departures)
        for row, req in enumerate(reqs):
            req.num_sampled += 1
            req.carry = launch
            req.carry_row = row
        self._unread.append(launch)
        return launch

    def _read_back(self, launches: list[_Launch], events: list[EngineEvent]) -> None:
        """Read back the tokens of ``launches``, oldest first: append each to its request, stream it, and
        finish requests that stop or reach their limit. Requests that finished or were aborted meanwhile
        are skipped (their later tokens were sampled for nothing).

        A decode launch of requests that do not detokenize, all still running, needs a decision only for its
        rows that end (`_Launch.last_rows`, stop tokens): the other rows are appended and go out as one
        `TokenBatch`."""
        finished = False
        for launch in launches:
            tokens = launch.read()
            now = time.perf_counter()
            batch = launch.batch
            if batch is None or not batch.ids_only or launch.departures != self._departures:
                for req, token in zip(launch.reqs, tokens):
                    finished |= self._take_token(req, token, now, events)
                continue
            ending = launch.last_rows
            if batch.stop_ids.size:
                stops = np.flatnonzero(np.isin(launch.host.numpy(), batch.stop_ids))
                if stops.size:
                    ending = np.union1d(ending, stops)
            reqs, steady = (
                launch.reqs,
                TokenBatch(batch.request_ids, tokens, batch.num_cached_tokens, now),
            )
            if ending.size:
                for i in ending.tolist():
                    finished |= self._take_token(reqs[i], tokens[i], now, events)
                going_on = np.ones(len(reqs), dtype=bool)
                going_on[ending] = False
                rows = np.flatnonzero(going_on).tolist()
                reqs, steady = [reqs[i] for i in rows], steady.rows(rows)
            for req, token in zip(reqs, steady.token_ids):
                req.output_ids.append(token)
            if reqs:
                events.append(steady)
        if (
            finished
        ):  # one pass, not a list removal per finished request (a whole batch may finish at once)
            self.active = [r for r in self.active if r.status is not Status.FINISHED]

    def _take_token(self, req: Request, token: int, now: float, events: list[EngineEvent]) -> bool:
        """Append ``token`` to a request, stream it as a delta, and finish the request if it stops or reaches
        its limit (returns whether it finished). A request no longer running skips it."""
        if req.status is not Status.RUNNING:
            return False
        out = req.output_ids
        out.append(token)
        detokenizer = req.detokenizer
        text = detokenizer.add(token) if detokenizer is not None else ""
        if token in req.stop_ids or len(out) >= req.max_output_len:
            self._release(req)
            events.append(
                self._finish(req, "stop" if token in req.stop_ids else "length", [token], text, now)
            )
            return True
        if text:
            req.text += text
        events.append(
            StreamDelta(req.request_id, [token], text, False, None, req.num_cached_tokens, now)
        )
        return False

    def _preempt(self, req: Request) -> None:
        """Free a request's blocks under memory pressure; its computed prefix stays in the tree, so its
        recompute is a cache hit. It resumes from the front of the queue with its output so far."""
        if req.status is Status.PREFILLING:
            self.prefilling.remove(req)
        self.active.remove(req)
        self._release(req)
        self._epoch += 1
        self._departures += 1
        req.status = Status.WAITING
        req.prompt_done = 0
        if (
            not req.num_sampled
        ):  # preempted before its first token: its next admission counts afresh
            c = self.counters
            c.prompt_tokens -= len(req.prompt_ids)
            c.cached_tokens -= req.num_cached_tokens
            c.computed_prompt_tokens -= req.num_computed_prompt_tokens
            c.recomputed_tokens += req.num_computed_prompt_tokens
            req.num_cached_tokens, req.num_computed_prompt_tokens = None, 0
        self.waiting.appendleft(req)
        self.counters.preemptions += 1

    # ------------------------------------------------------------------ sampling and output
    def _sample(
        self, reqs: list[Request], logits: torch.Tensor, greedy: bool | None = None
    ) -> torch.Tensor:
        """Sampled token ids ``[len(reqs)]`` on the device (no host sync). ``greedy``: whether every request
        samples greedily, when the caller knows."""
        if greedy is None:
            greedy = not any(r.params.temperature for r in reqs)
        if not greedy:
            batch = SamplingBatch.build(
                [r.params.temperature for r in reqs],
                [r.params.top_p for r in reqs],
                [r.params.top_k for r in reqs],
                [r.seed for r in reqs],
                [r.num_sampled for r in reqs],
                logits.device,
            )
        else:
            batch = SamplingBatch.greedy(logits.device)
        return sample(logits, batch)

    def _finish(
        self,
        req: Request,
        reason: str,
        token_ids: list[int],
        text: str = "",
        now: float | None = None,
    ) -> StreamDelta:
        if req.detokenizer is not None:
            text += req.detokenizer.flush()
        req.text += text
        if req.status is not Status.WAITING:
            self._epoch += 1
            self._departures += 1
        req.status = Status.FINISHED
        req.finish_reason = reason
        return StreamDelta(
            req.request_id,
            token_ids,
            text,
            True,
            reason,
            req.num_cached_tokens or 0,
            time.perf_counter() if now is None else now,
        )

    def _release(self, req: Request) -> None:
        """Publish what the request computed (prompt and generated tokens) and drop its blocks."""
        seq = req.seq
        if seq is None:
            return
        self.cache.release(seq, publish=req.token_array()[: seq.num_kv])
        req.seq = None

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request (the caller has read its output)."""
        req = self.requests.pop(request_id)
        assert req.status is Status.FINISHED
        return req

    # ------------------------------------------------------------------ cache control and stats
    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache. Refused while requests hold KV (their blocks would stay in use)."""
        if self.active:
            raise RuntimeError("reset_prefix_cache while requests are running")
        self.cache.reset()

    def cache_stats(self) -> dict[str, float | int]:
        c = self.counters
        return {
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "computed_prompt_tokens": c.computed_prompt_tokens,
            "recomputed_tokens": c.recomputed_tokens,
            "cow_copies": self.cache.counters.cow_copies,
            "evicted_blocks": self.cache.tree.counters.evicted_blocks,
            "free_blocks": self.cache.num_free_blocks,
            "total_blocks": self.cache.num_blocks,
            "preemptions": c.preemptions,
            "prefill_forwards": c.prefill_forwards,
            "decode_forwards": c.decode_forwards,
        }
