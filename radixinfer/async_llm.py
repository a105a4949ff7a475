"""The asyncio front: `AsyncLLM` serves one `LLM` to any number of concurrent callers.

The engine is single-threaded by contract, so one loop owns it (`radixinfer.engine_core`): on a
thread of this process (``AsyncLLM(llm)``), or in an engine process of its own
(``AsyncLLM(EngineProcess(**llm_kwargs))``, `radixinfer.engine_process`: what ``radixinfer serve``
runs, so the engine never waits for the GIL while the HTTP event loop streams). Both run the same
loop over the same messages (`radixinfer.core_messages`)::

    add_request / submit / abort / call  --(AddRequest, Abort, Call)-->  engine core: apply, step
    sinks: an event loop's router, queues <--(one StepOutput a step)---  events, call results

Each step's events go to their sinks as one list per sink: all the streams of one asyncio event loop
share one sink (`StreamRouter`, `radixinfer.async_stream`), so a step wakes the event loop once with
``call_soon_threadsafe``, not once a token per request, and the event loop fans the list out to the
streams. A stream whose consumer is behind takes everything that arrived for it at once
(`AsyncStream.next_deltas`): under load, per-token costs downstream fall without a fixed interval.
Streams decode their text themselves, on the consumer's thread, one decode per take (vLLM's front
detokenizes too): the engine runs their requests ids-only, so a steady decode step stays one
`TokenBatch` and the engine pays nothing per token for text. A consumer of many requests that is not
a coroutine (the benchmark) passes its own sink, a ``queue.SimpleQueue``, and receives the lists as
they are: a steady decode step's tokens of requests that do not detokenize stay one `TokenBatch`
there. A delta's ``timestamp`` is taken inside the engine step that produced its tokens (in
``perf_counter`` seconds, which an engine process on the same machine shares), so queueing between
the loop and a consumer never shows up in measured latencies.

Failures never leave a consumer waiting: a request the engine rejects gets a `StreamFailure`
carrying its ``ValueError``; an exception inside the loop, or an engine process that dies, fails
every open request with an `EngineLoopError` and makes later submissions raise it. `AsyncLLM.close`
aborts what is still running and stops the loop (and its process).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Protocol, TypeVar

import numpy as np

from radixinfer.api import LLM
from radixinfer.async_stream import StreamFront, check_front_options
from radixinfer.core_messages import (
    Abort,
    AddRequest,
    Call,
    Close,
    CoreFailed,
    CoreInput,
    CoreOutput,
    EventSplitter,
    Sink,
    StepOutput,
    StreamEvents,
    StreamFailure,
)
from radixinfer.engine.prompts import PromptChecker
from radixinfer.engine_core import ThreadCore
from radixinfer.engine_process import EngineConnection, EngineProcess, ProcessCore
from radixinfer.sampling_params import SamplingParams

T = TypeVar("T")


class EngineLoopError(RuntimeError):
    """The engine loop died; ``__cause__`` is the exception it died of."""


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already (a server answers 429)."""


class _Core(Protocol):
    """`ThreadCore` or `ProcessCore`: where the loop runs."""

    prompts: PromptChecker
    request_prefix: str  # of the request ids a front names

    def send(self, message: CoreInput) -> None: ...

    def join(self) -> None: ...


class AsyncLLM(StreamFront):
    """Serves ``llm`` to concurrent callers until `close`: an `LLM`, stepped on a thread of this
    process (nothing else may drive it meanwhile, no ``LLM.generate``), an `EngineProcess`,
    built and stepped in a process of its own (the constructor returns once it has loaded, and
    raises what loading raised), or an `EngineConnection` to an engine process that serves other
    fronts too (``radixinfer serve --api-server-count N``: one front per API server process;
    `close` then ends this front's connection, not the engine).

    ``max_waiting`` bounds the requests submitted and not yet admitted (no KV held yet): one more
    raises `QueueFullError` at once. ``request_timeout`` (seconds, None: none) is the default of
    `add_request`'s ``timeout``.

    The coroutine side (`add_request`, `generate`, the awaitable helpers) runs on any asyncio event
    loop; `submit`, `abort` and `call` may be used from any thread. Use as a context manager or call
    `close`: an engine thread is not a daemon, so a forgotten front keeps the process alive.
    """

    def __init__(
        self,
        llm: LLM | EngineProcess | EngineConnection,
        *,
        max_waiting: int | None = None,
        request_timeout: float | None = None,
    ) -> None:
        check_front_options(max_waiting, request_timeout)
        if not isinstance(llm, (LLM, EngineProcess, EngineConnection)):
            raise ValueError(
                "llm must be an LLM, an EngineProcess or an EngineConnection, got "
                f"{type(llm).__name__}"
            )
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self._lock = threading.Lock()  # what submitting threads and the delivering thread share
        self._sinks: dict[str, Sink] = {}  # open requests
        self._splitter = EventSplitter()  # of the delivering thread
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._num_submitted = 0
        self._num_taken = 0  # of those, taken by the core
        self._core_waiting = 0  # of those, queued for admission in the engine
        self._closing = False
        self._error: EngineLoopError | None = None
        if isinstance(llm, LLM):
            self._core: _Core = ThreadCore(llm, self._on_output)
        else:
            self._core = ProcessCore(llm, self._on_output)
        self._open_streams(self._core.prompts)

    # ------------------------------------------------------------------ coroutine side
    async def cache_stats(self) -> dict[str, float | int]:
        """``LLM.cache_stats()``, taken between two steps."""
        return await asyncio.wrap_future(self.call(_cache_stats))

    async def reset_prefix_cache(self) -> None:
        """Empty the prefix cache; ``RuntimeError`` while requests hold KV (the engine refuses
        then)."""
        await asyncio.wrap_future(self.call(_reset_prefix_cache))

    async def stats(self) -> dict[str, float | int]:
        """``LLM.cache_stats()`` plus ``running`` (requests holding KV) and ``waiting`` (queued for
        admission), taken together between two steps."""
        return await asyncio.wrap_future(self.call(_stats))

    # ------------------------------------------------------------------ any thread
    def submit_checked(
        self,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        cache_salt: Hashable,
        sink: Sink,
        *,
        request_id: str | None = None,
    ) -> str:
        """Queue a request, its prompt and params checked already (`StreamFront.submit` checks
        them), whose events go to ``sink`` (in lists, one per step, shared with the sink's other
        requests: a delta carries its ``request_id``, a `TokenBatch` one per row). Returns its
        request id: ``request_id`` when given (a front over several engines names its requests
        itself; it must be unique among this front's open requests), else a new one.

        Raises `QueueFullError`, `EngineLoopError` if the loop has died and ``RuntimeError`` after
        `close`; a request the engine rejects later gets a `StreamFailure`."""
        with self._lock:
            self._check_open()
            if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            if request_id is None:
                request_id = f"{self._core.request_prefix}{next(self._ids)}"
            self._sinks[request_id] = sink  # before the core can answer
            self._num_submitted += 1
            self._core.send(AddRequest(request_id, prompt_ids, params, cache_salt))
        return request_id

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id, or None when the engine runs on a thread of this process."""
        return getattr(self._core, "pid", None)

    @property
    def error(self) -> EngineLoopError | None:
        """What the engine loop died of, or None while it serves."""
        return self._error

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted (exact between steps, else off by what one step
        admits)."""
        return self._num_submitted - self._num_taken + self._core_waiting

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its sink gets a final ``"abort"`` delta. A no-op for a
        request that has already finished."""
        with self._lock:
            if not (self._closing or self._error is not None):
                self._core.send(Abort(request_id))

    def call(self, fn: Callable[[LLM], T]) -> Future[T]:
        """Run ``fn(llm)`` between two steps; the future holds its result or exception. With an
        engine process, ``fn`` and its result must pickle (a module-level function, plain data):
        ``fn`` that does not raises here."""
        future: Future[T] = Future()
        with self._lock:
            self._check_open()
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            try:
                self._core.send(Call(call_id, fn))
            except Exception:
                del self._calls[call_id]
                raise
        return future

    def close(self) -> None:
        """Abort every open request, stop the loop and wait for it (and its process). Idempotent."""
        with self._lock:
            if not self._closing:
                self._closing = True
                if self._error is None:
                    self._core.send(Close())
        self._core.join()

    def __enter__(self) -> AsyncLLM:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError("AsyncLLM is closed")
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ delivering thread
    def _on_output(self, output: CoreOutput) -> None:
        """Take one output of the core: on the engine thread, or on an engine process's reader."""
        if type(output) is StepOutput:
            with self._lock:
                self._num_taken, self._core_waiting = output.num_taken, output.num_waiting
            self._deliver(output.events)
            for result in output.results:
                future = self._calls.pop(result.call_id, None)
                if future is None or future.done():  # cancelled meanwhile
                    continue
                if result.error is None:
                    future.set_result(result.value)
                else:
                    future.set_exception(result.error)
        elif type(output) is CoreFailed:
            self._fail_everyone(output.error)

    def _deliver(self, events: StreamEvents) -> None:
        """Put ``events`` on their sinks, one list per sink (a `TokenBatch` split by sink); forget
        the requests that finished."""
        for sink, sink_events in self._splitter.split(events, self._sinks).items():
            sink.put(sink_events)

    def _fail_everyone(self, exc: BaseException) -> None:
        error = EngineLoopError(f"the engine loop failed: {exc!r}")
        error.__cause__ = exc
        with self._lock:
            self._error = error
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for request_id, sink in sinks.items():
            with contextlib.suppress(Exception):  # one broken sink must not keep the rest waiting
                sink.put([StreamFailure(request_id, error)])
        for future in calls.values():
            if not future.done():
                future.set_exception(error)


def _cache_stats(llm: LLM) -> dict[str, float | int]:
    return llm.cache_stats()


def _reset_prefix_cache(llm: LLM) -> None:
    llm.reset_prefix_cache()


def _stats(llm: LLM) -> dict[str, float | int]:
    engine = llm.engine
    return {**llm.cache_stats(), "running": len(engine.active), "waiting": len(engine.waiting)}
