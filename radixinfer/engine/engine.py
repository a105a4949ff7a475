"""The online engine: continuous batching over the prefix cache (DESIGN §4).

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

import array
import itertools
import random
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixinfer.cache.kv_manager import KVCacheManager, ReservePlan, SeqKV
from radixinfer.engine.admission import AdmissionConfig, Grant, plan_admission
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.engine.request import Request, Status
from radixinfer.engine.sampler import SamplingBatch, sample
from radixinfer.outputs import StreamDelta
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
    prompt_tokens: int = 0  # prompt tokens of admitted requests (counted once per request)
    cached_tokens: int = 0  # of those, found in the prefix cache at first admission
    computed_prompt_tokens: int = 0  # token rows run through prefill forwards (recomputes included)
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
    leaders: dict[tuple[Hashable, bytes], _PrefillItem] = field(default_factory=dict)  # (salt, prompt bytes)


class _Launch:
    """One forward's sampled tokens ``[len(reqs)]``: on the device, and on their way to pinned host memory
    without blocking. The engine reads them a step later, once the GPU has newer work queued behind them."""

    def __init__(self, reqs: list[Request], tokens: torch.Tensor) -> None:
        self.reqs, self.tokens = reqs, tokens
        self.host, self.done = tokens, None
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


@dataclass
class _DecodeStep:
    """The last decode launch: its batch, their sequences and block tables, and context lengths. While the
    next step decodes the same requests in the same order (the steady state) each sequence grew by exactly
    one position and decodes the token that launch sampled, so the next inputs follow from these without a
    pass over the requests. The tables are the sequences' own lists, and between two steps of one batch
    only `reserve` changes them (publishing and releasing happen to requests outside a decode batch), so
    the runner rewrites only the rows that reserve reports changed."""

    batch: list[Request]
    seqs: list[SeqKV]
    tables: list[list[int]]
    launch: _Launch
    context_lens: np.ndarray


_DEFER = object()  # `_plan_item`: must wait for the current pass's K/V writes


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
        self.max_context_len = runner.model.max_context_len
        self.counters = EngineCounters()
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # PREFILLING + RUNNING, in admission order
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._round = itertools.count()
        self._seeds = random.Random(config.seed)  # per-request sampling seeds when params.seed is None
        self._unread: list[_Launch] = []  # forwards launched this step, their tokens not read back yet
        self._last_decode: _DecodeStep | None = None

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: Hashable = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and enqueue. Raises ``ValueError`` naming the bad field; nothing is allocated then."""
        prompt_array = self._validate_prompt(prompt)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
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
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
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

    def _validate_prompt(self, prompt: str | list[int]) -> np.ndarray:
        """The prompt's token ids as the int64 array the request keeps (`Request.token_array`): converted once
        here, where checking the ids needs an array anyway. ``array("q", ids)`` converts at C speed and
        refuses what is not an integer (a float, a string) instead of truncating it."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
            if ids and isinstance(ids[0], bool):  # a mask passed as a prompt: bools are ints to Python
                raise ValueError("prompt: token ids must be integers, got bools")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) > self.max_context_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, longer than the model's context of {self.max_context_len}"
            )
        try:
            token_ids = np.frombuffer(array.array("q", ids), dtype=np.int64)
        except TypeError:
            raise ValueError("prompt: token ids must be integers") from None
        except OverflowError:
            raise ValueError(f"prompt: a token id is outside the vocabulary [0, {self.vocab_size})") from None
        if not (0 <= token_ids.min() and token_ids.max() < self.vocab_size):
            bad = int(token_ids[(token_ids < 0) | (token_ids >= self.vocab_size)][0])
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return token_ids

    def abort(self, request_id: str) -> StreamDelta | None:
        """Stop a request wherever it is; its blocks are released at once. Returns its final delta."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            self.active.remove(req)
            self._release(req)
        return self._finish(req, "abort", [])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active or self._unread)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StreamDelta]:
        """Launch this step's forwards, then read back and emit the tokens the previous step launched: the
        host never waits for the forward it just launched, so its work overlaps the GPU's."""
        deltas: list[StreamDelta] = []
        previous, self._unread = self._unread, []
        if self.config.decode_first:
            self._decode(previous, deltas)
            self._prefill_round(deltas)
        else:
            self._prefill_round(deltas)
            self._decode(previous, deltas)
        return deltas

    # ------------------------------------------------------------------ prefill
    def _prefill_round(self, deltas: list[StreamDelta]) -> None:
        """Admit what the policy grants and run it as one ragged forward. Requests that would copy a block
        this forward is still writing (they extend a prefix another request of the round computes) run in
        a second pass right after it."""
        admission = self.config.admission
        first = _Pass()
        # Chunked prompts in progress continue first: they hold blocks and a locked path.
        budget = admission.max_tokens
        prefilling = Status.PREFILLING
        for req in [r for r in self.active if r.status is prefilling]:
            if budget <= 0 or not self._plan_item(first, req, budget, fresh=False):
                break
            budget -= first.items[-1].end - first.items[-1].start
        deferred: list[Grant[Request]] = []
        cap = self.config.max_num_seqs
        free_slots = admission.max_requests if cap is None else cap - len(self.active)
        if self.waiting and free_slots > 0 and budget > 0:
            candidates = list(itertools.islice(self.waiting, max(admission.lookahead, admission.max_requests)))
            for grant in plan_admission(
                candidates, admission, next(self._round), cost_of=self._uncached_cost,
                cached_of=self._cached_len, max_requests=free_slots, max_tokens=budget,
            ):
                outcome = self._plan_item(first, grant.item, grant.num_tokens, fresh=True, may_defer=True)
                if outcome is _DEFER:
                    deferred.append(grant)
                elif not outcome:
                    break  # KV memory is short: the rest waits
        self._run_prefill_pass(first, deltas)
        if deferred:
            # A request that would now copy a block the second pass itself writes waits for the next round.
            second = _Pass()
            for grant in deferred:
                if not self._plan_item(second, grant.item, grant.num_tokens, fresh=True, may_defer=True):
                    break
            self._run_prefill_pass(second, deltas)

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
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = seq.num_cached
                self.counters.prompt_tokens += len(req.prompt_ids)
                self.counters.cached_tokens += seq.num_cached
        seq = req.seq
        start = seq.num_kv
        if start >= n:  # the whole prompt is cached
            leader = None if seq.payload is not None else pass_.leaders.get((req.salt, tokens.tobytes()))
            if seq.payload is not None or leader is not None:  # nothing to compute
                item = _PrefillItem(req, n, n, [], payload=seq.payload, leader=leader)
            else:  # recompute the last position for fresh logits; its K/V is already stored
                item = _PrefillItem(req, n - 1, n, [-1])
        else:
            end = min(n, start + max(num_tokens, 1))
            plan = self.cache.reserve([seq], [end])
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
            self.waiting.remove(req)
            self.active.append(req)
            req.status = Status.PREFILLING
        return True

    def _run_prefill_pass(self, pass_: _Pass, deltas: list[StreamDelta]) -> None:
        items = pass_.items
        if not items:
            return
        self.runner.kv.copy_blocks(pass_.copies)
        computed = [it for it in items if it.end > it.start]
        hidden = None
        if computed:
            lengths = np.fromiter((it.end - it.start for it in computed), dtype=np.int64, count=len(computed))
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
            self.counters.computed_prompt_tokens += len(input_ids)
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
            req.status = Status.RUNNING  # decodes from its first token, on the device until read back
        self._launch(reqs, self._sample(reqs, self.runner.logits(last_hidden)))

    # ------------------------------------------------------------------ decode
    def _decode(self, previous: list[_Launch], deltas: list[StreamDelta]) -> None:
        """Launch this step's decode, then read back ``previous`` (the launches of the step before) while
        the GPU runs it.

        A request whose newest token is still on the device decodes it from there: the host sees tokens one
        step late. A request that turns out to have stopped on such a token was decoded once more for
        nothing; its extra K/V is for a real position of its path (the stop token's), so it stays valid.
        """
        batch = self._decode_batch()
        last = self._last_decode
        repeated = last is not None and last.batch == batch  # the same requests, by identity, in the same order
        seqs = last.seqs if repeated else [r.seq for r in batch]
        plan = self.cache.reserve(seqs) if batch else None
        if batch and plan is None:
            # Preemption publishes each victim's tokens: read back every launch first.
            self._read_back(previous + self._unread, deltas)
            previous, self._unread, repeated = [], [], False
            batch, plan = self._preempt_until_reserved()
            seqs = [r.seq for r in batch]
        if batch:
            self.runner.kv.copy_blocks(plan.copies)
            inputs = self._repeated_decode_inputs(last) if repeated else self._decode_inputs(batch)
            input_ids, positions, tables, context_lens, carried, carried_rows = inputs
            logits = self.runner.decode(
                input_ids, positions, plan.slots, tables, context_lens, carried=carried, carried_rows=carried_rows,
                changed_tables=plan.changed if repeated else None,
            )
            self.cache.mark_written()
            self.counters.decode_forwards += 1
            launch = self._launch(batch, self._sample(batch, logits))
            self._last_decode = _DecodeStep(batch, seqs, tables, launch, np.asarray(context_lens, dtype=np.int64))
        else:
            self._last_decode = None
        self._read_back(previous, deltas)

    @staticmethod
    def _repeated_decode_inputs(last: _DecodeStep) -> tuple:
        """`_decode_inputs` without a pass over the requests, for a step that decodes ``last``'s batch again."""
        n = len(last.batch)
        lens = last.context_lens
        return np.zeros(n, np.int64), lens, last.tables, lens + 1, last.launch.tokens, None

    @staticmethod
    def _decode_inputs(batch: list[Request]) -> tuple[list[int], list[int], list[list[int]], list[int],
                                                      torch.Tensor | None, list[int] | None]:
        """``(input_ids, positions, tables, context_lens, carried, carried_rows)`` for `ModelRunner.decode`,
        in one pass over the batch (its slots are reserved: ``num_kv`` counts the new position). A sequence's
        input token is its id when read back (carried row -1), else a placeholder id and its row in the
        concatenated tokens of the launches that sampled them (the last decode, this step's prefill)."""
        offsets: dict[_Launch, int] = {}
        total = 0
        input_ids, positions, tables, context_lens, rows = [], [], [], [], []
        for req in batch:
            seq = req.seq
            num_kv = seq.num_kv
            positions.append(num_kv - 1)
            context_lens.append(num_kv)
            tables.append(seq.table)
            launch = req.carry
            if launch is None:
                input_ids.append(req.output_ids[-1])
                rows.append(-1)
                continue
            offset = offsets.get(launch)
            if offset is None:
                offset = offsets[launch] = total
                total += len(launch.reqs)
            input_ids.append(0)
            rows.append(offset + req.carry_row)
        if not offsets:
            return input_ids, positions, tables, context_lens, None, None
        tokens = [launch.tokens for launch in offsets]
        carried = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
        return input_ids, positions, tables, context_lens, carried, rows

    def _decode_batch(self) -> list[Request]:
        """Running requests with room for one more token, oldest first, at most ``max_batch_size``."""
        running = Status.RUNNING
        batch = [r for r in self.active if r.status is running and r.num_sampled < r.max_output_len]
        del batch[self.config.max_batch_size :]  # the rest wait for a slot
        return batch

    def _preempt_until_reserved(self) -> tuple[list[Request], ReservePlan | None]:
        """Preempt the newest requests until the decode batch fits (every token read back); (batch, plan)."""
        while True:
            batch = self._decode_batch()
            if not batch:
                return [], None
            plan = self.cache.reserve([r.seq for r in batch])
            if plan is not None:
                return batch, plan
            self._preempt(max(self.active, key=lambda r: r.arrival_index))

    def _launch(self, reqs: list[Request], tokens: torch.Tensor) -> _Launch:
        """Record that ``tokens`` (sampled on the device, one per request) will be read back next step."""
        launch = _Launch(reqs, tokens)
        for row, req in enumerate(reqs):
            req.num_sampled += 1
            req.carry = launch
            req.carry_row = row
        self._unread.append(launch)
        return launch

    def _read_back(self, launches: list[_Launch], deltas: list[StreamDelta]) -> None:
        """Read back the tokens of ``launches``, oldest first: append each to its request, stream it, and
        finish requests that stop or reach their limit. Requests that finished or were aborted meanwhile
        are skipped (their later tokens were sampled for nothing)."""
        running = Status.RUNNING
        finished = False
        for launch in launches:
            tokens = launch.read()
            now = time.perf_counter()
            for req, token in zip(launch.reqs, tokens):
                if req.carry is launch:
                    req.carry = None
                if req.status is not running:
                    continue
                out = req.output_ids
                out.append(token)
                detokenizer = req.detokenizer
                text = detokenizer.add(token) if detokenizer is not None else ""
                if token in req.stop_ids or len(out) >= req.max_output_len:
                    self._release(req)
                    deltas.append(self._finish(req, "stop" if token in req.stop_ids else "length", [token], text, now))
                    finished = True
                else:
                    if text:
                        req.text += text
                    deltas.append(StreamDelta(req.request_id, [token], text, False, None, req.num_cached_tokens, now))
        if finished:  # one pass, not a list removal per finished request (a whole batch may finish at once)
            self.active = [r for r in self.active if r.status is not Status.FINISHED]

    def _preempt(self, req: Request) -> None:
        """Free a request's blocks under memory pressure; its computed prefix stays in the tree, so its
        recompute is a cache hit. It resumes from the front of the queue with its output so far."""
        self.active.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.prompt_done = 0
        self.waiting.appendleft(req)
        self.counters.preemptions += 1

    # ------------------------------------------------------------------ sampling and output
    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Sampled token ids ``[len(reqs)]`` on the device (no host sync)."""
        temperatures = [r.params.temperature for r in reqs]
        if any(temperatures):
            batch = SamplingBatch.build(
                temperatures,
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
        self, req: Request, reason: str, token_ids: list[int], text: str = "", now: float | None = None
    ) -> StreamDelta:
        if req.detokenizer is not None:
            text += req.detokenizer.flush()
        req.text += text
        req.status = Status.FINISHED
        req.finish_reason = reason
        return StreamDelta(
            req.request_id, token_ids, text, True, reason, max(req.num_cached_tokens, 0),
            time.perf_counter() if now is None else now,
        )

    def _release(self, req: Request) -> None:
        """Publish what the request computed (prompt and generated tokens) and drop its blocks."""
        seq = req.seq
        if seq is None:
            return
        self.cache.publish(seq, req.token_array()[: seq.num_kv])
        self.cache.release(seq)
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
            "cow_copies": self.cache.counters.cow_copies,
            "evicted_blocks": self.cache.tree.counters.evicted_blocks,
            "free_blocks": self.cache.num_free_blocks,
            "total_blocks": self.cache.num_blocks,
            "preemptions": c.preemptions,
            "prefill_forwards": c.prefill_forwards,
            "decode_forwards": c.decode_forwards,
        }
