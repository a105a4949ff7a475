"""The streaming front: one background thread owns an `LLMEngine`; any thread submits requests and reads
their tokens back as they are produced.

The engine is single-threaded by contract (docs/request-lifecycle.md), so every engine call happens on the loop thread.
Other threads only touch three small inboxes (submissions, aborts, calls) under one condition variable::

    submit() / abort() / call()  --(inbox, notify)-->  loop thread: add / abort / run calls, engine.step()
    handle / sink queue          <--[events]-------   one list per queue per step, in order

The loop sleeps on the condition while the engine has nothing to do (no polling), and steps it back to
back while it has. A delta's ``timestamp`` is taken inside the engine step that produced its tokens, so
queueing between the loop and a consumer never shows up in measured latencies. A queue receives each
step's events for its requests as one list: a consumer of many requests wakes once a step, not once a token
(each wake-up takes the GIL from the loop thread while it prepares the next step). For the same reason a
steady decode step's tokens travel as one `TokenBatch` per queue (the rows of that queue's requests), not
as a delta per token; a `StreamHandle` hands them out as deltas.

Failures never leave a consumer waiting: a request the engine rejects (``ValueError``) gets a
`StreamFailure` carrying that error; an exception inside the loop fails every open request with an
`EngineLoopError` and makes later submissions raise it. `close` aborts what is still running (each
consumer gets a final ``finish_reason="abort"`` delta) and joins the thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from radixinfer.engine.engine import LLMEngine
from radixinfer.outputs import EngineEvent, StreamDelta, TokenBatch
from radixinfer.sampling_params import SamplingParams

T = TypeVar("T")


class EngineLoopError(RuntimeError):
    """The engine loop died; ``__cause__`` is the exception it died of."""


@dataclass(frozen=True)
class StreamFailure:
    """Put on a request's queue instead of further deltas when the request cannot go on."""

    request_id: str
    error: BaseException
    # Like a delta's flag: nothing follows it. A consumer of many requests checks ``event.finished`` on every
    # event and tells failures apart only then.
    finished: ClassVar[bool] = True


StreamEvent = StreamDelta | TokenBatch | StreamFailure
StreamEvents = list[StreamEvent]  # what a queue receives: one step's events for its requests, in order


class StreamHandle:
    """One submitted request. Iterate it for its deltas (the last has ``finished`` set); iteration raises the
    request's error instead when it fails. Only the thread that iterates should consume ``queue``."""

    def __init__(self, server: EngineServer, request_id: str, events: queue.SimpleQueue[StreamEvents]) -> None:
        self.request_id = request_id
        self.queue = events
        self._server = server

    def __iter__(self) -> Iterator[StreamDelta]:
        while True:
            for event in self.queue.get():
                if isinstance(event, StreamFailure):
                    raise event.error
                if isinstance(event, TokenBatch):
                    yield from event.deltas()
                    continue
                yield event
                if event.finished:
                    return

    def abort(self) -> None:
        self._server.abort(self.request_id)


@dataclass
class _Submission:
    request_id: str
    prompt: str | np.ndarray  # text, or token ids already checked (`LLMEngine.prompt_ids`)
    params: SamplingParams
    cache_salt: str | None
    sink: queue.SimpleQueue[StreamEvents]


class EngineServer:
    """Runs ``engine`` on a background thread until `close`. Thread-safe: `submit`, `abort` and `call` may be
    used from any thread. Nothing else may drive the engine while the server owns it (no ``LLM.generate``).

    Use as a context manager, or call `close` yourself: the loop thread is not a daemon, so a forgotten
    server keeps the process alive.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._submissions: list[_Submission] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[LLMEngine], Any], Future]] = []
        self._sinks: dict[str, queue.SimpleQueue[StreamEvents]] = {}  # open requests (loop thread only)
        self._ids = itertools.count()
        self._closing = False
        self._error: EngineLoopError | None = None
        self._thread = threading.Thread(target=self._loop, name="radixinfer-engine", daemon=False)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def submit(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        sink: queue.SimpleQueue[StreamEvents] | None = None,
    ) -> StreamHandle:
        """Queue a request and return its handle at once (the loop adds it before its next step).

        ``sink``: a queue to receive this request's events instead of a private one, so one consumer can
        wait on many requests: it gets lists of events (each list one step's; a delta carries its
        ``request_id``, a `TokenBatch` one per row).
        A prompt the engine rejects yields a `StreamFailure` with the engine's ``ValueError``. Raises
        `EngineLoopError` if the loop has died and ``RuntimeError`` after `close`.
        """
        events: queue.SimpleQueue[StreamEvents] = sink if sink is not None else queue.SimpleQueue()
        prompt_ids, error = prompt, None
        if not isinstance(prompt, str):  # token ids are checked and converted here, not on the engine loop
            try:
                prompt_ids = self._engine.prompt_ids(prompt)
            except ValueError as exc:
                error = exc
        with self._cond:
            self._check_open()
            request_id = f"srv-{next(self._ids)}"
            if error is not None:
                events.put([StreamFailure(request_id, error)])
            else:
                params = SamplingParams() if params is None else params
                self._submissions.append(_Submission(request_id, prompt_ids, params, cache_salt, events))
                self._cond.notify()
        return StreamHandle(self, request_id, events)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its consumer gets a final ``"abort"`` delta. A no-op for a request
        that has already finished."""
        with self._cond:
            if self._closing or self._error is not None:
                return
            self._aborts.append(request_id)
            self._cond.notify()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread between two steps (e.g. ``cache_stats``,
        ``reset_prefix_cache`` when idle); the future holds its result or exception."""
        future: Future[T] = Future()
        with self._cond:
            self._check_open()
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Abort every open request, stop the loop and join it. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise RuntimeError("EngineServer is closed")

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        try:
            while self._serve_once():
                pass
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the consumers
            self._fail_everyone(exc)

    def _serve_once(self) -> bool:
        """Take the inboxes (sleeping while there is nothing to do), apply them, run one engine step.
        Returns False once the server is closing and every request has been aborted."""
        engine = self._engine
        with self._cond:
            while not (self._submissions or self._aborts or self._calls or self._closing or engine.has_unfinished()):
                self._cond.wait()
            submissions, self._submissions = self._submissions, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            closing = self._closing
        self._sinks.update((sub.request_id, sub.sink) for sub in submissions)  # failed by the loop if it dies
        for sub in submissions:
            try:
                engine.add_request(sub.prompt, sub.params, sub.cache_salt, request_id=sub.request_id)
            except ValueError as exc:
                del self._sinks[sub.request_id]
                sub.sink.put([StreamFailure(sub.request_id, exc)])
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(exc)
        aborted = [engine.abort(r) for r in (list(self._sinks) if closing else aborts) if r in self._sinks]
        self._deliver([delta for delta in aborted if delta is not None])
        if closing:
            return False
        if engine.has_unfinished():
            self._deliver(engine.step())
        return True

    def _deliver(self, events: list[EngineEvent]) -> None:
        """Put ``events`` on their queues, one list per queue (a `TokenBatch` split by queue); forget the
        requests that finished."""
        batches: dict[queue.SimpleQueue[StreamEvents], StreamEvents] = {}  # queues hash by identity
        sinks = self._sinks
        for event in events:
            if type(event) is TokenBatch:
                self._route_batch(event, batches)
                continue
            sink = sinks[event.request_id]
            if event.finished:
                del sinks[event.request_id]
                self._engine.pop_finished(event.request_id)
            batches.setdefault(sink, []).append(event)
        for sink, sink_events in batches.items():
            sink.put(sink_events)

    def _route_batch(self, batch: TokenBatch, batches: dict[queue.SimpleQueue[StreamEvents], StreamEvents]) -> None:
        """Add ``batch`` to ``batches``: whole when one queue takes all its rows (one consumer of many
        requests: no per-row object), else as one `TokenBatch` of its rows per queue."""
        routes = [self._sinks[request_id] for request_id in batch.request_ids]
        if routes.count(routes[0]) == len(routes):
            batches.setdefault(routes[0], []).append(batch)
            return
        rows: dict[queue.SimpleQueue[StreamEvents], list[int]] = {}
        for row, sink in enumerate(routes):
            rows.setdefault(sink, []).append(row)
        for sink, sink_rows in rows.items():
            batches.setdefault(sink, []).append(batch.rows(sink_rows))

    def _fail_everyone(self, exc: BaseException) -> None:
        error = EngineLoopError(f"the engine loop failed: {exc!r}")
        error.__cause__ = exc
        with self._cond:
            self._error = error
            pending = [(s.request_id, s.sink) for s in self._submissions] + list(self._sinks.items())
            calls = self._calls
            self._submissions, self._calls, self._aborts = [], [], []
        self._sinks.clear()
        for request_id, sink in pending:
            sink.put([StreamFailure(request_id, error)])
        for _, future in calls:
            future.set_exception(error)
