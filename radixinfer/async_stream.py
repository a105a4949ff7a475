"""The coroutine side of `radixinfer.AsyncLLM`'s streams: `AsyncStream`, one request's deltas as
an async iterator, and `StreamRouter`, the sink of every stream opened on one asyncio event loop.

A step's events for one event loop arrive as one list with one ``call_soon_threadsafe``; the event
loop fans them out to their streams. A stream whose consumer is behind takes everything that
arrived for it at once (`AsyncStream.next_deltas`) and, when it detokenizes, decodes its text on
the consumer's thread, one decode per take.

The rows of a steady decode step (`TokenBatch`: one token, no text, no logprobs, never a request's
last) that reach a stream while its consumer has not taken the previous ones join the delta still
waiting there instead of queueing one delta each: a consumer that is behind by k steps takes one
delta of k tokens (timestamped with the last step), and what it costs per take, not per token,
stays flat however far behind it is. Each step's time stays in `AsyncStream.step_times`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Protocol

import numpy as np

from radixinfer.core_messages import Sink, StreamEvents, StreamFailure
from radixinfer.engine.prompts import PromptChecker
from radixinfer.outputs import StreamDelta, TokenBatch
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import IncrementalDetokenizer

# what a front takes as a prompt: text, or token ids
PromptInput = str | list[int] | np.ndarray


class _Owner(Protocol):
    """What a stream calls back: the front that can abort its request."""

    def abort(self, request_id: str) -> None: ...


class RequestTimeoutError(TimeoutError):
    """A request ran past its timeout and was aborted."""


class StreamRouter:
    """The sink of every stream opened on one asyncio event loop: the loop thread hands it a step's
    events with one ``call_soon_threadsafe``, and the event loop routes them to their streams."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.streams: dict[str, AsyncStream] = {}

    def open(
        self,
        owner: _Owner,
        request_id: str,
        prompt_ids: np.ndarray,
        timeout: float | None,
        detokenizer: IncrementalDetokenizer | None,
    ) -> AsyncStream:
        stream = AsyncStream(owner, self, request_id, prompt_ids, detokenizer)
        self.streams[request_id] = stream
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
                t = event.timestamp
                rows = zip(event.request_ids, event.token_ids, event.num_cached_tokens)
                for request_id, token, cached in rows:
                    stream = streams.get(request_id)
                    if stream is not None:
                        stream._push_token(token, cached, t)
                continue
            stream = streams.get(event.request_id)
            if stream is not None:
                stream._push(event)


class AsyncStream:
    """One request's deltas, as an async iterator (the last delta has ``finished`` set); iteration
    raises the request's error instead when it fails (`RequestTimeoutError` past its timeout).
    ``prompt_token_ids`` is the prompt as the engine runs it. Use it on the event loop that opened
    it. ``step_times``: the time of each engine step that gave the request tokens, in order, once
    per step (a step's deltas of several completions share it): per-step latencies when a delta
    holds the tokens of several steps."""

    def __init__(
        self,
        owner: _Owner,
        router: StreamRouter,
        request_id: str,
        prompt_ids: np.ndarray,
        detokenizer: IncrementalDetokenizer | None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_ids
        self.finished = False
        self._owner = owner
        self._router = router
        self.step_times: list[float] = []
        self._events: deque[StreamDelta | StreamFailure] = deque()
        self._open: StreamDelta | None = None  # the last of _events, built here: rows join it
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._detokenizer = detokenizer

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if not self._events:
            if self.finished:
                raise StopAsyncIteration
            await self._wait()
        event = self._events.popleft()
        if event is self._open:
            self._open = None
        return self._take([event])[0]

    async def next_deltas(self) -> list[StreamDelta]:
        """Every delta that has arrived since the last call, waiting for at least one (a consumer
        that fell behind takes several steps' tokens at once, and their text, decoded at once, is
        on the last of them); ``[]`` once the stream has ended."""
        if not self._events:
            if self.finished:
                return []
            await self._wait()
        events, self._events = self._events, deque()
        self._open = None
        return self._take(list(events))

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

    def _take(self, events: list[StreamDelta | StreamFailure]) -> list[StreamDelta]:
        """Hand ``events`` to the consumer: a failure raises its error instead. When the stream
        detokenizes, the text of all their tokens goes on the last delta."""
        for event in events:
            if type(event) is StreamFailure:
                self.close()
                raise event.error
        last = events[-1]
        if last.finished:
            self.finished = True
            self.close()
        if self._detokenizer is not None:
            ids = last.token_ids if len(events) == 1 else [t for d in events for t in d.token_ids]
            text = self._detokenizer.add_many(ids)
            if last.finished:
                text += self._detokenizer.flush()
            last.text = text  # the stream's own delta (the router built it, or unpickled it)
        return events

    def _push_token(self, token: int, num_cached: int, timestamp: float) -> None:
        """One row of a `TokenBatch`: joins the delta built from earlier rows if the consumer has
        not taken it yet (a delta of several steps' tokens, timestamped with the last)."""
        delta = self._open
        if delta is None:
            delta = StreamDelta(self.request_id, [token], "", False, None, num_cached, timestamp)
            self._push(delta)
            self._open = delta
        else:
            self.step_times.append(timestamp)  # a later step: a stream has one row a batch
            delta.token_ids.append(token)
            delta.timestamp = timestamp
            delta.num_cached_tokens = num_cached

    def _push(self, event: StreamDelta | StreamFailure) -> None:
        if event.finished:
            self._router.streams.pop(self.request_id, None)
        if type(event) is StreamDelta and event.token_ids:
            times = self.step_times
            if not times or times[-1] != event.timestamp:
                times.append(event.timestamp)
        self._open = None
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


def check_front_options(max_waiting: int | None, request_timeout: float | None) -> None:
    """A front's waiting bound and default timeout, checked before it starts anything."""
    if max_waiting is not None and (isinstance(max_waiting, bool) or max_waiting < 1):
        raise ValueError(f"max_waiting must be a positive integer or None, got {max_waiting!r}")
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0 seconds or None, got {request_timeout!r}")


def checked_params(params: SamplingParams | None) -> SamplingParams:
    """``params``, or the defaults for None; ``ValueError`` for anything else."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


class StreamFront:
    """The coroutine side shared by the fronts (`radixinfer.AsyncLLM`, one engine;
    `radixinfer.data_parallel.DataParallelLLM`, several): `add_request` and `generate` open a stream
    over the front's `submit`, with the front's own `StreamRouter` of the running event loop as
    the sink. A subclass calls `_open_streams` once its prompt checker is known and implements
    `submit` and `abort`."""

    prompts: PromptChecker
    request_timeout: float | None

    def _open_streams(self, prompts: PromptChecker) -> None:
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.max_context_len: int = prompts.max_context_len
        self._routers: dict[asyncio.AbstractEventLoop, StreamRouter] = {}

    # what a subclass implements: queue a prompt and params checked already whose events go to a
    # sink (returns its request id), and abort a request
    submit_checked: Callable[[np.ndarray, SamplingParams, Hashable, Sink], str]
    abort: Callable[[str], None]

    def submit(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams | None,
        cache_salt: Hashable,
        sink: Sink,
    ) -> str:
        """Check a request and queue it (`submit_checked`); its events go to ``sink``. Returns its
        request id at once; callable from any thread. Raises ``ValueError`` for a bad prompt or
        params, and what `submit_checked` raises."""
        return self.submit_checked(
            self.prompts.token_ids(prompt), checked_params(params), cache_salt, sink
        )

    def add_request(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams | None = None,
        cache_salt: Hashable = None,
        *,
        timeout: float | None = None,
    ) -> AsyncStream:
        """Queue a request and return its stream at once; call from a coroutine. Raises
        ``ValueError`` for a bad prompt (checked here), what `submit` raises (a full queue, a dead
        engine, a closed front); errors the engine finds later (a request too large for the pool)
        are raised by the stream.

        The caller must iterate the stream to its end or `AsyncStream.close` it (`generate` does
        both). A string prompt is encoded here, on the caller's thread, and the stream's text is
        decoded there too, as the consumer takes its tokens: the engine only samples."""
        loop = asyncio.get_running_loop()
        router = self._routers.get(loop)
        if router is None:  # a new event loop: forget the routers of closed ones
            self._routers = {old: r for old, r in self._routers.items() if not old.is_closed()}
            router = self._routers[loop] = StreamRouter(loop)
        prompt_ids = self.prompts.token_ids(prompt)
        params = checked_params(params)
        timeout = self.request_timeout if timeout is None else timeout
        # The engine streams ids only (a steady decode step is one TokenBatch) and the stream decodes
        # what its consumer takes, all of it at once; except where the engine needs the text itself.
        front_decodes = params.detokenize and not params.needs_engine_text
        detokenizer = IncrementalDetokenizer(self.tokenizer) if front_decodes else None
        if front_decodes:
            params = params.ids_only()
        request_id = self.submit_checked(prompt_ids, params, cache_salt, router)
        return router.open(self, request_id, prompt_ids, timeout, detokenizer)

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
