"""The bench's run loop: one workload (sessions of one or more turns, each submitted at its arrival
offset) through one open backend, every token's timestamp recorded. `radixinfer.bench.runner` drives
it over every variant, side by side."""

from __future__ import annotations

import argparse
import heapq
import itertools
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from radixinfer.bench.args import sampling_fields
from radixinfer.bench.backends import Backend
from radixinfer.bench.metrics import RequestRecord
from radixinfer.bench.workloads import Session, fit_to_context
from radixinfer.core_messages import StreamFailure
from radixinfer.outputs import TokenBatch
from radixinfer.sampling_params import SamplingParams


@dataclass
class _Turn:
    session: Session
    index: int
    prompt: list[int]
    record: RequestRecord


def request_for(
    session: Session, prompt: list[int], max_context_len: int, args: argparse.Namespace
) -> tuple[list[int], SamplingParams]:
    """What the bench submits for one turn of ``session``: the prompt fitted to the context (left-truncated with
    ``--truncate-prompts``, else ValueError) and its sampling params. Like the engine, it never asks for more
    tokens than the context holds (a model could not index their positions); ids only (``detokenize=False``)."""
    prompt = fit_to_context(prompt, max_context_len, args.truncate_prompts)
    max_tokens = min(session.max_tokens, max(1, max_context_len - len(prompt)))
    return prompt, SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=args.ignore_eos,
        detokenize=False,
        n=args.n,
        **sampling_fields(args),
    )


def run_workload(
    backend: Backend,
    sessions: list[Session],
    offsets: list[float],
    args: argparse.Namespace,
    desc: str,
    start: Callable[[], float] = time.perf_counter,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Submit each session's first turn at its offset and each later turn once the previous answer is
    complete and the session's think time after it has passed; collect every token's timestamp. Returns
    the records (one per turn) and the wall time from the first submit to the last token (`wall_time`). A
    failed request raises RuntimeError.

    ``start`` is called once the first turns are ready and returns the ``perf_counter`` time the offsets
    count from (client processes that share a workload start together, `radixinfer.bench.client_processes`);
    ``progress``: show a progress bar.

    This thread shares the GIL with the engine's, so its per-token work is kept to appending ids and times
    (objects the collector does not track: keeping every delta alive instead made the collector's pauses
    ~9x longer on the 256-request random run, 15 ms against 1.7 ms). Requests ask for token ids only
    (``detokenize=False``): nothing here reads text."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    inflight: dict[str, _Turn] = {}
    records: list[RequestRecord] = []
    progress = tqdm(
        total=sum(s.num_turns for s in sessions),
        desc=desc,
        unit="req",
        file=sys.stderr,
        leave=False,
        disable=not progress,
    )
    # Turns not yet submitted, by when they are due: (due time, order, session, turn, prompt, params,
    # the prompt in the backend's form); ``order`` keeps equal times in submission order.
    due: list[tuple[float, int, Session, int, list[int], SamplingParams, Any]] = []
    order = itertools.count()

    # First turns are known up front: fitted and in the backend's form before the clock starts
    # (`Backend.native_prompt`).
    first = [request_for(s, s.prompt, backend.max_context_len, args) for s in sessions]
    native_first = [backend.native_prompt(prompt) for prompt, _ in first]
    started = start()
    for i, session in enumerate(sessions):
        due.append((started + offsets[i], next(order), session, 0, *first[i], native_first[i]))
    heapq.heapify(due)
    with progress:
        while due or inflight:
            while due and time.perf_counter() >= due[0][0]:
                _, _, session, index, prompt, params, native = heapq.heappop(due)
                record = RequestRecord(time.perf_counter(), len(prompt))
                request_id = backend.submit(native, params, events)
                inflight[request_id] = _Turn(session, index, prompt, record)
            timeout = max(0.0, due[0][0] - time.perf_counter()) if due else None
            try:
                batch = events.get(timeout=timeout)
            except queue.Empty:
                continue
            for event in batch:
                if type(event) is TokenBatch:  # one token for each of many requests, none finishing
                    timestamp = event.timestamp
                    for request_id, token in zip(event.request_ids, event.token_ids):
                        inflight[request_id].record.add_token(token, timestamp)
                    continue
                if event.finished and isinstance(event, StreamFailure):
                    raise RuntimeError(
                        f"request {event.request_id} failed: {event.error}"
                    ) from event.error
                turn = inflight[event.request_id]
                turn.record.add(event)
                if not event.finished:
                    continue
                del inflight[event.request_id]
                records.append(turn.record)
                progress.update(1)
                session, index = turn.session, turn.index
                if index + 1 < session.num_turns:
                    answered = session.next_prompt(index, turn.prompt, turn.record.token_ids)
                    prompt, params = request_for(session, answered, backend.max_context_len, args)
                    when = time.perf_counter() + session.think_time(index)
                    heapq.heappush(
                        due, (when, next(order), session, index + 1, prompt, params, prompt)
                    )
    return records, wall_time(records)


def wall_time(records: list[RequestRecord]) -> float:
    """Seconds from the first submit to the last token of ``records`` (not empty)."""
    first_submit = min(r.submit_time for r in records)
    last_token = max((r.token_times[-1] for r in records if r.token_times), default=first_submit)
    return last_token - first_submit
