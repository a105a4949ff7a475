"""The asyncio front: `AsyncLLM` serves one `LLM` to any number of concurrent callers.

The engine is single-threaded by contract, so one background thread owns it and makes every engine
call. Callers only touch three small inboxes (submissions, aborts, calls) under one condition
variable::

    add_request / submit / abort / call  --(inbox, notify)-->  loop thread: add, abort, call, step
    sinks: an event loop's router, queues <--[events]-------   one list per sink per step, in order

The loop sleeps on the condition while the engine has nothing to do (no polling) and steps it back
to back while it has. Each step's events go to their sinks as one list per sink: all the streams of
one asyncio event loop share one sink (`_Router`), so the loop thread wakes the event loop once a
step with ``call_soon_threadsafe``, not once a token per request, and the event loop fans the list
out to the streams. A consumer of many requests that is not a coroutine (the benchmark) passes its
own sink, a ``queue.SimpleQueue``, and receives the lists as they are: a steady decode step's tokens
of requests that do not detokenize stay one `TokenBatch` there. A delta's ``timestamp`` is taken
inside the engine step that produced its tokens, so queueing between the loop and a consumer never
shows up in measured latencies.

Failures never leave a consumer waiting: a request the engine rejects gets a `StreamFailure`
carrying its ``ValueError``; an exception inside the loop fails every open request with an
`EngineLoopError` and makes later submissions raise it. `AsyncLLM.close` aborts what is still
running and joins the thread.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from radixinfer.api import LLM
from radixinfer.outputs import EngineEvent, StreamDelta, TokenBatch
from radixinfer.sampling_params import SamplingParams

T = TypeVar("T")


class EngineLoopError(RuntimeError):
    """The engine loop died; ``__cause__`` is the exception it died of."""


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already (a server answers 429)."""


class RequestTimeoutError(TimeoutError):
    """A request ran past its timeout and was aborted."""


@dataclass(frozen=True)
class StreamFailure:
    """Put on a request's sink instead of further deltas when the request cannot go on."""

    request_id: str
    error: BaseException
    # Like a delta's flag: nothing follows it. A consumer of many requests checks
    # ``event.finished`` on every event and tells failures apart only then.
    finished: ClassVar[bool] = True


StreamEvent = StreamDelta | TokenBatch | StreamFailure
# what a sink receives: one step's events for its requests, in order
StreamEvents = list[StreamEvent]


class Sink(Protocol):
    """Where the loop thread puts a step's events of the requests submitted with it. ``put`` runs on
    the loop thread: it must not block (``queue.SimpleQueue.put`` qualifies)."""

    def put(self, events: StreamEvents) -> None: ...


@dataclass
class _Submission:
    request_id: str
    prompt: np.ndarray  # token ids, checked (`LLMEngine.prompt_ids`)
    params: SamplingParams
    cache_salt: Hashable
    sink: Sink


class AsyncLLM:
    """Serves ``llm`` from a background thread to concurrent callers until `close`.

    ``max_waiting`` bounds the requests submitted and not yet admitted (no KV held yet): one more
    raises `QueueFullError` at once. ``request_timeout`` (seconds, None: none) is the default of
    `add_request`'s ``timeout``. Nothing else may drive ``llm`` while this front owns it (no
    ``LLM.generate``).

    The coroutine side (`add_request`, `generate`, the awaitable helpers) runs on any asyncio event
    loop; `submit`, `abort` and `call` may be used from any thread. Use as a context manager or call
    `close`: the loop thread is not a daemon, so a forgotten front keeps the process alive.
    """

    def __init__(
        self, llm: LLM, *, max_waiting: int | None = None, request_timeout: float | None = None
    ) -> None:
        if max_waiting is not None and (isinstance(max_waiting, bool) or max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive integer or None, got {max_waiting!r}")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(
                f"request_timeout must be > 0 seconds or None, got {request_timeout!r}"
            )
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.max_context_len: int = llm.engine.max_context_len
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self._engine = llm.engine
        self._cond = threading.Condition()
        self._submissions: list[_Submission] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[LLM], Any], Future]] = []
        self._sinks: dict[str, Sink] = {}  # open requests (loop thread only)
        self._routers: dict[asyncio.AbstractEventLoop, _Router] = {}
        self._ids = itertools.count()
        self._closing = False
        self._error: EngineLoopError | None = None
        self._thread = threading.Thread(target=self._loop, name="radixinfer-engine", daemon=False)
        self._thread.start()

    # ------------------------------------------------------------------ coroutine side
    def add_request(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams | None = None,
        cache_salt: Hashable = None,
        *,
        timeout: float | None = None,
    ) -> AsyncStream:
        """Queue a request and return its stream at once; call from a coroutine. Raises
        ``ValueError`` for a bad prompt (checked here), `QueueFullError`, `EngineLoopError` and
        ``RuntimeError`` after `close`; errors the engine finds later (a request too large for the
        pool) are raised by the stream.

        The caller must iterate the stream to its end or `AsyncStream.close` it (`generate` does
        both). A string prompt is encoded here, on the caller's thread (the engine thread only
        decodes)."""
        loop = asyncio.get_running_loop()
        router = self._routers.get(loop)
        if router is None:  # a new event loop: forget the routers of closed ones
            self._routers = {old: r for old, r in self._routers.items() if not old.is_closed()}
            router = self._routers[loop] = _Router(loop)
        prompt_ids = self._engine.prompt_ids(prompt)
        timeout = self.request_timeout if timeout is None else timeout
        request_id = self.submit(prompt_ids, params, cache_salt, router)
        return router.open(self, request_id, prompt_ids, timeout)

    async def generate(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams | None = None,
        cache_salt: Hashable = None,
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Yield the request's deltas as they are produced (the last has ``finished`` set).
        Cancelling the consumer, or closing the iterator early, aborts the request and frees its
        blocks within a step."""
        stream = self.add_request(prompt, params, cache_salt, timeout=timeout)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def cache_stats(self) -> dict[str, float | int]:
        """``LLM.cache_stats()``, taken between two steps."""
        return await asyncio.wrap_future(self.call(lambda llm: llm.cache_stats()))

    async def reset_prefix_cache(self) -> None:
        """Empty the prefix cache; ``RuntimeError`` while requests hold KV (the engine refuses
        then)."""
        await asyncio.wrap_future(self.call(lambda llm: llm.reset_prefix_cache()))

    async def stats(self) -> dict[str, float | int]:
        """``LLM.cache_stats()`` plus ``running`` (requests holding KV) and ``waiting`` (queued for
        admission), taken together between two steps."""
        return await asyncio.wrap_future(self.call(_stats))

    # ------------------------------------------------------------------ any thread
    def submit(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams | None,
        cache_salt: Hashable,
        sink: Sink,
    ) -> str:
        """Queue a request whose events go to ``sink`` (in lists, one per step, shared with the
        sink's other requests: a delta carries its ``request_id``, a `TokenBatch` one per row).
        Returns its request id.

        Raises ``ValueError`` for a bad prompt, `QueueFullError`, `EngineLoopError` if the loop has
        died and ``RuntimeError`` after `close`; a request the engine rejects later gets a
        `StreamFailure`."""
        prompt_ids = self._engine.prompt_ids(prompt)
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        with self._cond:
            self._check_open()
            if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            request_id = f"req-{next(self._ids)}"
            submission = _Submission(
                request_id, prompt_ids, params or SamplingParams(), cache_salt, sink
            )
            self._submissions.append(submission)
            self._cond.notify()
        return request_id

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted (exact between steps, else off by what one step
        admits)."""
        return len(self._submissions) + len(self._engine.waiting)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its sink gets a final ``"abort"`` delta. A no-op for a
        request that has already finished."""
        with self._cond:
            if self._closing or self._error is not None:
                return
            self._aborts.append(request_id)
            self._cond.notify()

    def call(self, fn: Callable[[LLM], T]) -> Future[T]:
        """Run ``fn(llm)`` on the loop thread between two steps; the future holds its result or
        exception."""
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

    def __enter__(self) -> AsyncLLM:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise RuntimeError("AsyncLLM is closed")

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        try:
            while self._serve_once():
                pass
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the consumers
            self._fail_everyone(exc)

    def _serve_once(self) -> bool:
        """Take the inboxes (sleeping while there is nothing to do), apply them, run one engine
        step. Returns False once the front is closing and every request has been aborted."""
        engine = self._engine
        with self._cond:
            while not (
                self._submissions
                or self._aborts
                or self._calls
                or self._closing
                or engine.has_unfinished()
            ):
                self._cond.wait()
            submissions, self._submissions = self._submissions, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            closing = self._closing
        # registered first: the loop fails them too if it dies
        self._sinks.update((sub.request_id, sub.sink) for sub in submissions)
        failures: list[EngineEvent | StreamFailure] = []
        for sub in submissions:
            try:
                engine.add_request(
                    sub.prompt, sub.params, sub.cache_salt, request_id=sub.request_id
                )
            except ValueError as exc:
                failures.append(StreamFailure(sub.request_id, exc))
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.llm))
                except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(exc)
        to_abort = list(self._sinks) if closing else aborts
        aborted = [engine.abort(r) for r in to_abort if r in self._sinks]
        failures += [delta for delta in aborted if delta is not None]
        self._deliver(failures)
        if closing:
            return False
        if engine.has_unfinished():
            self._deliver(engine.step())
        return True

    def _deliver(self, events: list[EngineEvent | StreamFailure]) -> None:
        """Put ``events`` on their sinks, one list per sink (a `TokenBatch` split by sink); forget
        the requests that finished."""
        batches: dict[Sink, StreamEvents] = {}  # sinks hash by identity
        sinks = self._sinks
        for event in events:
            if type(event) is TokenBatch:
                self._route_batch(event, batches)
                continue
            request_id = event.request_id
            sink = sinks[request_id]
            if event.finished:
                del sinks[request_id]
                if request_id in self._engine.requests:
                    self._engine.pop_finished(request_id)
            batches.setdefault(sink, []).append(event)
        for sink, sink_events in batches.items():
            sink.put(sink_events)

    def _route_batch(self, batch: TokenBatch, batches: dict[Sink, StreamEvents]) -> None:
        """Add ``batch`` to ``batches``: whole when one sink takes all its rows (one consumer of
        many requests: no per-row object), else as one `TokenBatch` of its rows per sink."""
        routes = [self._sinks[request_id] for request_id in batch.request_ids]
        if routes.count(routes[0]) == len(routes):
            batches.setdefault(routes[0], []).append(batch)
            return
        rows: dict[Sink, list[int]] = {}
        for row, sink in enumerate(routes):
            rows.setdefault(sink, []).append(row)
        for sink, sink_rows in rows.items():
            batches.setdefault(sink, []).append(batch.rows(sink_rows))

    def _fail_everyone(self, exc: BaseException) -> None:
        error = EngineLoopError(f"the engine loop failed: {exc!r}")
        error.__cause__ = exc
        with self._cond:
            self._error = error
            pending = [(s.request_id, s.sink) for s in self._submissions] + list(
                self._sinks.items()
            )
            calls = self._calls
            self._submissions, self._calls, self._aborts = [], [], []
        self._sinks.clear()
        for request_id, sink in pending:
            sink.put([StreamFailure(request_id, error)])
        for _, future in calls:
            future.set_exception(error)


def _stats(llm: LLM) -> dict[str, float | int]:
    engine = llm.engine
    return {**llm.cache_stats(), "running": len(engine.active), "waiting": len(engine.waiting)}


class _Router:
    """The sink of every stream opened on one asyncio event loop: the loop thread hands it a step's
    events with one ``call_soon_threadsafe``, and the event loop routes them to their streams."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.streams: dict[str, AsyncStream] = {}

    def open(
        self, owner: AsyncLLM, request_id: str, prompt_ids: np.ndarray, timeout: float | None
    ) -> AsyncStream:
        stream = self.streams[request_id] = AsyncStream(owner, self, request_id, prompt_ids)
        if timeout is not None:
            stream._timer = self.loop.call_later(timeout, stream._expire, timeout)
        return stream

    def put(self, events: StreamEvents) -> None:  # loop thread
        try:
            self.loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _dispatch(self, events: StreamEvents) -> None:  # event loop
        streams = self.streams
        for event in events:
            if type(event) is TokenBatch:
                for delta in event.deltas():
                    stream = streams.get(delta.request_id)
                    if stream is not None:
                        stream._push(delta)
                continue
            stream = streams.get(event.request_id)
            if stream is not None:
                stream._push(event)


class AsyncStream:
    """One request's deltas, as an async iterator (the last delta has ``finished`` set); iteration
    raises the request's error instead when it fails (`RequestTimeoutError` past its timeout).
    ``prompt_token_ids`` is the prompt as the engine runs it. Use it on the event loop that opened
    it."""

    def __init__(
        self, owner: AsyncLLM, router: _Router, request_id: str, prompt_ids: np.ndarray
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_ids
        self.finished = False
        self._owner = owner
        self._router = router
        self._events: deque[StreamDelta | StreamFailure] = deque()
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if not self._events:
            if self.finished:
                raise StopAsyncIteration
            await self._wait()
        return self._take(self._events.popleft())

    async def next_deltas(self) -> list[StreamDelta]:
        """Every delta that has arrived since the last call, waiting for at least one (a consumer
        that fell behind takes several steps' tokens at once); ``[]`` once the stream has ended."""
        if not self._events:
            if self.finished:
                return []
            await self._wait()
        events, self._events = self._events, deque()
        return [self._take(event) for event in events]

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished. Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
        self._router.streams.pop(self.request_id, None)
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def _wait(self) -> None:
        self._waiter = self._router.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self, event: StreamDelta | StreamFailure) -> StreamDelta:
        if isinstance(event, StreamFailure):
            self.close()
            raise event.error
        if event.finished:
            self.finished = True
            self.close()
        return event

    def _push(self, event: StreamDelta | StreamFailure) -> None:
        if event.finished:
            self._router.streams.pop(self.request_id, None)
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self, timeout: float) -> None:
        self._timer = None
        if self.request_id in self._router.streams:
            error = RequestTimeoutError(f"the request ran past its timeout of {timeout:g} s")
            self._push(StreamFailure(self.request_id, error))
            self._owner.abort(self.request_id)  # now, not when the consumer reads the failure
