"""The coroutine side of `radixinfer.AsyncLLM`'s streams: `AsyncStream`, one request's deltas as
an async iterator, and `StreamRouter`, the sink of every stream opened on one asyncio event loop.

A step's events for one event loop arrive as one list with one ``call_soon_threadsafe``; the event
loop fans them out to their streams. A stream whose consumer is behind takes everything that
arrived for it at once (`AsyncStream.next_deltas`) and, when it detokenizes, decodes its text on
the consumer's thread, one decode per take.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from radixinfer.core_messages import StreamEvents, StreamFailure
from radixinfer.outputs import StreamDelta, TokenBatch
from radixinfer.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from radixinfer.async_llm import AsyncLLM


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
        owner: AsyncLLM,
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
        self,
        owner: AsyncLLM,
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
        self._events: deque[StreamDelta | StreamFailure] = deque()
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
        return self._take([self._events.popleft()])[0]

    async def next_deltas(self) -> list[StreamDelta]:
        """Every delta that has arrived since the last call, waiting for at least one (a consumer
        that fell behind takes several steps' tokens at once, and their text, decoded at once, is
        on the last of them); ``[]`` once the stream has ended."""
        if not self._events:
            if self.finished:
                return []
            await self._wait()
        events, self._events = self._events, deque()
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
