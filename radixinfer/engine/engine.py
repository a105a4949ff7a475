"""The online engine: continuous batching over the prefix cache (docs/request-lifecycle.md).

``add_request`` / ``abort`` / ``step`` are meant to be driven by one thread (the `LLM` API or a
server loop). Each ``step`` runs one prefill round (the scheduler's `PrefillPlan`: one ragged
forward, plus at most one more pass for requests that must copy a block the first pass is writing)
and one batched decode step, in the order ``decode_first`` asks for; then the output processor reads
back the tokens the previous step launched (`radixinfer.engine.pipeline`: no forward is waited for
in the step that launches it).

The parts, one job each: `RequestIntake` (checks and builds requests), `Scheduler` (queues, plans,
preemption), `DecodeBatch` (the persistent decode batch), `TokenPipeline` (launches and their
read-back a step later), `OutputProcessor` (stop checks, detokenization, deltas), and the runner and
the cache they drive.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from radixinfer.cache.kv_manager import KVCacheManager
from radixinfer.engine.config import EngineConfig, EngineCounters, cache_stats
from radixinfer.engine.decode_batch import DecodeBatch
from radixinfer.engine.host_kv import NO_LOADS, HostKVPool
from radixinfer.engine.intake import RequestIntake
from radixinfer.engine.logprobs import collect_prompt_logprobs, logprob_rows
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.engine.output import OutputProcessor
from radixinfer.engine.pipeline import Launch, TokenPipeline, device_index
from radixinfer.engine.prefill_plan import PrefillPass
from radixinfer.engine.prompts import PromptChecker
from radixinfer.engine.request import Request, Status
from radixinfer.engine.scheduler import Scheduler
from radixinfer.outputs import EngineEvent, StreamDelta
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import Tokenizer

__all__ = ["EngineConfig", "EngineCounters", "LLMEngine"]


class LLMEngine:
    """The step loop over the engine's parts. ``requests`` maps every request not yet popped
    (`pop_finished`) to its state; ``waiting`` / ``active`` / ``prefilling`` are the scheduler's
    queues."""

    def __init__(
        self,
        runner: ModelRunner,
        cache: KVCacheManager,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        config: EngineConfig,
        host_kv: HostKVPool | None = None,
    ) -> None:
        """``host_kv``: the host tier's blocks, when ``cache`` has a host tier (its queued transfers
        run before every block copy and forward; a request reading loaded blocks joins a forward
        once their loads completed)."""
        self.runner = runner
        self.cache = cache
        self.host_kv = host_kv
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.config = config
        self.vocab_size = runner.model.vocab_size
        self.max_context_len = runner.max_context_len  # the model's, or max_model_len when lower
        self.counters = EngineCounters()
        self.requests: dict[str, Request] = {}
        self.intake = RequestIntake(
            tokenizer, self.eos_token_ids, self.vocab_size, self.max_context_len,
            cache.block_size, cache.num_blocks, config.seed, config.max_batch_size,
        )  # fmt: skip
        self.scheduler = Scheduler(cache, config, self.counters)
        self.pipeline = TokenPipeline()
        self.output = OutputProcessor(self.scheduler, tokenizer)
        self.sampler = runner.sampler  # the one the memory profile sampled through
        # the most rows a prefill pass's logits work holds at once: the rows the profile sampled
        self._sample_rows = runner.prefill_max_seqs

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def active(self) -> list[Request]:  # PREFILLING + RUNNING, in admission order
        return self.scheduler.active

    @property
    def prefilling(self) -> list[Request]:
        return self.scheduler.prefilling

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and enqueue. Raises ``ValueError`` naming the bad field; nothing is allocated
        then. ``cache_salt``: None, or a non-empty string; requests with different salts never share
        cached KV."""
        req = self.intake.request(prompt, params, cache_salt, request_id, self.requests)
        self.requests[req.request_id] = req
        self.scheduler.waiting.append(req)
        return req.request_id

    def prompt_ids(self, prompt: str | list[int] | np.ndarray) -> np.ndarray:
        """The prompt's token ids, checked, as an int64 array (`RequestIntake.prompt_ids`; any
        thread may call it for token ids)."""
        return self.intake.prompt_ids(prompt)

    @property
    def prompts(self) -> PromptChecker:
        """The engine's prompt checker (`PromptChecker`): a front checks prompts with it, on any
        thread or in another process."""
        return self.intake.prompts

    def abort(self, request_id: str) -> StreamDelta | None:
        """Stop a request (every sample of it) wherever it is; its blocks are released at once.
        Returns its final delta (``finished`` set), or None when it had finished already."""
        first = self.requests.get(request_id)
        if first is None or first.group_finished():
            return None
        if any(r.seq is not None and self.cache.is_loading(r.seq) for r in first.group):
            self._finish_loads(wait=True)  # its blocks may be handed out again at once
        last = None
        for req in first.group:
            if req.status is Status.FINISHED:
                continue
            if req.status is Status.WAITING:
                self.scheduler.waiting.remove(req)
            elif req.status is not Status.FORKING:
                self.counters.count_abort(req)
                self.scheduler.leave(req)
            last = self.output.finish(req, "abort", [])
        return last

    def is_finished(self, request_id: str) -> bool:
        """Whether every sample of the request has finished (its output is ready to pop)."""
        return self.requests[request_id].group_finished()

    def has_unfinished(self) -> bool:
        scheduler = self.scheduler
        return bool(scheduler.waiting or scheduler.active or self.pipeline.has_unread())

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request (the caller has read its output): its first sample, whose
        ``group`` holds every sample."""
        req = self.requests.pop(request_id)
        assert req.group_finished()
        return req

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineEvent]:
        """Launch this step's forwards, then read back and emit the tokens the previous step
        launched: the host never waits for the forward it just launched, so its work overlaps the
        device's.

        Returns the step's events in order: a `StreamDelta` per request with news, except that a
        steady decode step's tokens come as one `TokenBatch` (`radixinfer.outputs.deltas_of` gives
        deltas only)."""
        events: list[EngineEvent] = []
        self._finish_loads()
        previous = self.pipeline.next_step()
        if self.config.decode_first:
            decoded = self._decode(previous, events)
            prefilled = self._prefill_round()
        else:
            prefilled = self._prefill_round()
            decoded = self._decode(previous, events)
        if not (prefilled or decoded or previous) and self.scheduler.active:
            if self.scheduler.held_for_loads:  # nothing else runs: wait for their loads
                self._finish_loads(wait=True)
            else:
                # Chunked prompts hold the memory that each of them needs to go on, and nothing
                # runs that could free some: preempt the newest (its computed prefix stays
                # cached), so the oldest always proceeds.
                self.scheduler.preempt_newest()
        return events

    def _prefill_round(self) -> bool:
        """Run the scheduler's prefill round: its first pass, then a second one for its deferred
        requests and for those held for loads from the host tier whose loads have completed. The
        device waits for the loads (`_join_loads`) only when it has nothing else to run this step
        (the first pass computed nothing and no request decodes): otherwise the loads cross the
        bus beside this step's forwards, and the requests whose loads are still in flight join a
        later round (waiting for them in every round idles the device while the bus works).
        Returns whether anything was prefilled."""
        scheduler = self.scheduler
        plan = scheduler.plan_prefill()
        self._run_prefill_pass(plan.first)  # the loads of the requests held for them start here
        if scheduler.held_for_loads:
            if self._device_busy(plan.first):
                self._finish_loads()  # those already loaded join (on a CPU, every one)
            else:
                self._join_loads()
        if not (plan.deferred or scheduler.held_for_loads):
            return bool(plan.first.items)
        second = scheduler.plan_deferred(plan.deferred)
        self._run_prefill_pass(second)
        return bool(plan.first.items or second.items)

    def _run_prefill_pass(self, pass_: PrefillPass) -> None:
        """Copy the pass's blocks, run its ragged forward, and launch the first token of every
        request whose prompt it completes."""
        self._copy_blocks(pass_.copies)  # the loads of requests held for them start here too
        items = pass_.items
        if not items:
            return
        computed = [it for it in items if it.computes]
        hidden = None
        if computed:
            hidden = self.runner.prefill(*pass_.ragged_inputs(computed))
            self.cache.mark_written()
            self.counters.prefill_forwards += 1
            self.counters.count_computed(computed)
            scored = [it for it in computed if it.req.needs_prompt_logprobs()]
            if scored:
                collect_prompt_logprobs(
                    scored, hidden, self.runner.logits, self.output.token_text, self._sample_rows
                )
        finishing = [it for it in items if it.end == it.req.num_tokens]
        for it in items:
            it.req.prompt_done = it.end
        if not finishing:
            return
        last_hidden = pass_.last_hidden(finishing, hidden)  # [len(finishing), hidden]
        if self.cache.enable_prefix_cache:
            for i, it in enumerate(finishing):
                if it.payload is None and it.leader is None:
                    self.cache.attach_payload(it.req.seq, last_hidden[i])
        reqs = [it.req for it in finishing]
        rows = list(range(len(reqs)))  # each request's row of `last_hidden`
        for row, req in enumerate(reqs[:]):
            # the further samples of an n > 1 request (most requests have none: no call)
            samples = self.scheduler.fork(req) if len(req.group) > 1 else ()
            reqs += samples
            rows += [row] * len(samples)
        self.scheduler.start_running(reqs)  # decodes from its first token, on the device for now
        if len(rows) == len(finishing):
            self._sample_and_launch(reqs, self.runner.logits(last_hidden), logprob_rows(reqs))
            return
        # Forked samples: the LM head and the sampler run on at most the rows the memory plan
        # sampled at once (n samples of many requests would be far more), one launch each.
        step = self._sample_rows
        for start in range(0, len(reqs), step):
            part = reqs[start : start + step]
            index = device_index(rows[start : start + step], last_hidden.device)
            logits = self.runner.logits(last_hidden.index_select(0, index))
            self._sample_and_launch(part, logits, logprob_rows(part))

    def _sample_and_launch(
        self,
        reqs: list[Request],
        logits: torch.Tensor,
        scored_rows: list[int],
        batch: DecodeBatch | None = None,
    ) -> torch.Tensor:
        """Sample a token per row of ``logits`` and launch them, with the raw logprobs of
        ``scored_rows`` when some ask (taken before the sampler may change ``logits``)."""
        greedy = None if batch is None else batch.greedy
        tokens, scores = self.sampler.sample_with_logprobs(reqs, logits, scored_rows, greedy)
        departures = None if batch is None else self.scheduler.departures
        self.pipeline.launch(reqs, tokens, batch, departures, scores)
        return tokens

    def _decode(self, previous: list[Launch], events: list[EngineEvent]) -> bool:
        """Launch this step's decode, then read back ``previous`` (the launches of the step before)
        while the device runs it. Returns whether a decode step ran.

        A request whose newest token is still on the device decodes it from there: the host sees
        tokens one step late. A request that turns out to have stopped on such a token was decoded
        once more for nothing; its extra K/V is for a real position of its path (the stop token's),
        so it stays valid."""
        scheduler = self.scheduler
        batch, repeated = scheduler.decode_batch()
        plan = self.cache.reserve_step(batch.lanes) if batch is not None else None
        if batch is not None and plan is None:
            # Preemption publishes each victim's tokens: read back every launch first (and a
            # victim's blocks may be handed out at once: let its loads complete).
            self.output.read_back(self.pipeline.take_all(), events)
            self._finish_loads(wait=True)
            previous, repeated = [], False
            batch, plan = scheduler.preempt_until_reserved()
        scheduler.last_decode = batch
        if batch is not None:
            self._copy_blocks(plan.copies)
            lanes = batch.lanes
            if repeated:
                input_ids, carried, carried_rows = batch.repeated_inputs()
            else:
                input_ids, carried, carried_rows = self.pipeline.decode_inputs(batch.reqs)
            logits = self.runner.decode(
                input_ids, lanes.num_kv - 1, plan.slots, batch.tables, lanes.num_kv,
                carried=carried, carried_rows=carried_rows, changed_tables=plan.changed,
            )  # fmt: skip
            self.cache.mark_written()
            self.counters.decode_forwards += 1
            self.counters.decode_read_bytes += self.runner.last_decode_read_bytes
            batch.tokens = self._sample_and_launch(batch.reqs, logits, batch.logprob_rows, batch)
            batch.left -= 1
        self.output.read_back(previous, events)
        return batch is not None

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Run the host tier's queued transfers, then the step's copy-on-writes: every block a
        forward reads or writes is where the cache says once this returns (in stream order)."""
        if self.host_kv is not None:
            kv = self.runner.kv
            batches = self.cache.take_transfers()
            self.host_kv.run(batches, kv.k, kv.v, self.cache.host.tickets_taken)
        if copies:  # (most steps copy nothing)
            self.runner.copy_blocks(copies)

    def _device_busy(self, first: PrefillPass) -> bool:
        """Whether this step runs a forward besides the loads: ``first`` computes, or a request
        decodes."""
        scheduler = self.scheduler
        computes = any(it.computes for it in first.items)
        return computes or len(scheduler.active) > len(scheduler.prefilling)

    def _join_loads(self) -> None:
        """Have the device run whatever comes next after every load queued so far (on a GPU the
        current stream waits for the side stream; the host does not wait), and tell the cache
        they completed: the requests held for them join the round's second pass, their loads
        overlapping the first pass's forward instead of holding them a step."""
        self.host_kv.join()
        self.cache.host.finish_loads(self.cache.host.tickets_taken)

    def _finish_loads(self, wait: bool = False) -> None:
        """Tell the cache which of the host tier's loads have completed (``wait``: wait for all of
        them first), so the requests held for them join the next pass."""
        if self.host_kv is not None:
            self.cache.host.finish_loads(self.host_kv.finished_ticket(wait))

    # ------------------------------------------------------------------ cache control and stats
    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache. Refused while requests hold KV (their blocks would stay in
        use)."""
        if self.scheduler.active:
            raise RuntimeError("reset_prefix_cache while requests are running")
        self.cache.reset()

    def cache_stats(self) -> dict[str, float | int]:
        """The engine's counters and the pools' state. ``cached_tokens`` = ``gpu_hit_tokens`` (read
        where they were) + ``host_hit_tokens`` (loaded back from the host tier first);
        ``loaded_tokens`` / ``offloaded_tokens``: positions moved between the tiers, at a load and at
        an eviction; ``written_through_tokens``: copied to the host ahead of eviction,
        ``evicted_to_copy_tokens``: evicted onto such a copy, moving nothing; ``loaded_bytes`` over
        ``load_seconds`` (the completed loads' device time): ``load_gb_per_s`` (the ``host_*``,
        tier and load entries are 0 without a host tier)."""
        loads = self.host_kv.load_stats() if self.host_kv is not None else NO_LOADS
        return cache_stats(self.counters, self.cache, loads)
