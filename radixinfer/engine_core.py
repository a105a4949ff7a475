"""The engine core: the loop that owns an `LLM` and serves a front (`radixinfer.AsyncLLM`), and
`ThreadCore`, which runs it on a thread of the front's process (`radixinfer.engine_process` runs it
in an engine process of its own)::

    front (AsyncLLM)                                 core (EngineCore.run)
    AddRequest, Abort, Call, Close  --- channel -->  takes every message between two steps
                                                     (sleeps while the engine has nothing to do)
    routes events, resolves calls  <-- channel ---  one StepOutput per step: the step's events (a
                                                     steady decode step's tokens as one TokenBatch),
                                                     call results, the waiting queue's counts

The loop is one piece of code; only the channel differs (the messages: `radixinfer.core_messages`).
`ThreadCore` passes messages by reference (a `Call` may run any callable) and its core thread hands
each output to the front itself.

Failures never leave a caller waiting: a request the engine rejects becomes a `StreamFailure` among
the step's events; an exception in the loop ends it with `CoreFailed`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from radixinfer.api import LLM
from radixinfer.core_messages import (
    Abort,
    AddRequest,
    Call,
    CallResult,
    CoreChannel,
    CoreFailed,
    CoreInput,
    CoreOutput,
    StepOutput,
    StreamFailure,
)
from radixinfer.outputs import EngineEvent


class EngineCore:
    """The loop over ``llm``'s engine: applies the front's messages between two steps, in the order
    sent, steps while the engine has work, and emits one `StepOutput` a pass when there is news.
    Finished requests are forgotten by the engine (``pop_finished``) before their events leave."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.engine
        self._num_taken = 0
        self._reported = (0, 0)  # (num_taken, num_waiting) as last emitted

    def run(self, channel: CoreChannel) -> None:
        """Serve until a `Close` (every open request aborted first) or until the front is gone; an
        exception ends the loop with a `CoreFailed`."""
        try:
            while self._serve_once(channel):
                pass
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the front
            channel.emit(CoreFailed(exc))

    def _serve_once(self, channel: CoreChannel) -> bool:
        engine = self.engine
        events: list[EngineEvent | StreamFailure] = []
        results: list[CallResult] = []
        closing = False
        for message in channel.take(block=not engine.has_unfinished()):
            kind = type(message)
            if kind is AddRequest:
                self._num_taken += 1
                try:
                    engine.add_request(
                        message.prompt,
                        message.params,
                        message.cache_salt,
                        request_id=message.request_id,
                    )
                except ValueError as exc:
                    events.append(StreamFailure(message.request_id, exc))
            elif kind is Abort:
                if (aborted := engine.abort(message.request_id)) is not None:
                    events.append(aborted)
            elif kind is Call:
                try:
                    results.append(CallResult(message.call_id, message.fn(self.llm), None))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    results.append(CallResult(message.call_id, None, exc))
            else:
                closing = True
        if closing:
            aborted = (engine.abort(request_id) for request_id in list(engine.requests))
            events += [delta for delta in aborted if delta is not None]
        elif engine.has_unfinished():
            events += engine.step()
        requests = engine.requests
        for event in events:
            if event.finished and event.request_id in requests:
                engine.pop_finished(event.request_id)
        counts = (self._num_taken, len(engine.waiting))
        if events or results or counts != self._reported:
            self._reported = counts
            channel.emit(StepOutput(events, results, *counts))
        return not closing


class ThreadCore:
    """An `EngineCore` on a thread of this process (named ``radixinfer-engine``, not a daemon).
    Messages pass by reference; the core thread calls ``on_output`` with each output itself."""

    def __init__(self, llm: LLM, on_output: Callable[[CoreOutput], None]) -> None:
        self.prompts = llm.engine.prompts
        self.request_prefix = "req-"
        self._on_output = on_output
        self._cond = threading.Condition()
        self._inbox: list[CoreInput] = []
        self._thread = threading.Thread(
            target=EngineCore(llm).run, args=(self,), name="radixinfer-engine", daemon=False
        )
        self._thread.start()

    def send(self, message: CoreInput) -> None:
        with self._cond:
            self._inbox.append(message)
            self._cond.notify()

    def take(self, block: bool) -> list[CoreInput]:
        with self._cond:
            while block and not self._inbox:
                self._cond.wait()
            messages, self._inbox = self._inbox, []
        return messages

    def emit(self, output: CoreOutput) -> None:
        self._on_output(output)

    def join(self) -> None:
        """Wait for the loop to end (after a `Close`)."""
        if self._thread is not threading.current_thread():
            self._thread.join()
