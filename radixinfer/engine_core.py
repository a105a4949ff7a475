"""The engine core: the loop that owns an `LLM` and serves a front (`radixinfer.AsyncLLM`), and the
two places it runs, a thread of the front's process or an engine process of its own::

    front (AsyncLLM)                                 core (EngineCore.run)
    AddRequest, Abort, Call, Close  --- channel -->  takes every message between two steps
                                                     (sleeps while the engine has nothing to do)
    routes events, resolves calls  <-- channel ---  one StepOutput per step: the step's events (a
                                                     steady decode step's tokens as one TokenBatch),
                                                     call results, the waiting queue's counts

The loop is one piece of code; only the channel differs. `ThreadCore` passes messages by reference
(a `Call` may run any callable) and its core thread hands each output to the front itself.
`ProcessCore` starts the loop in a process of multiprocessing's spawn context and pickles messages
over one duplex pipe, so the engine never shares a GIL with the front's event loop (an HTTP server
streaming hundreds of requests). Each end of the pipe writes from a sender thread fed by a queue:
a slow reader never stalls a step, nor a busy engine the front's event loop.

Failures never leave a caller waiting: a request the engine rejects becomes a `StreamFailure` among
the step's events; an exception in the loop ends it with `CoreFailed`; an engine process that dies
(killed, crashed) closes its end of the pipe, which the front's reader turns into `CoreFailed`.
"""

from __future__ import annotations

import gc
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Protocol

import numpy as np

from radixinfer.api import LLM
from radixinfer.engine.prompts import PromptChecker
from radixinfer.outputs import EngineEvent
from radixinfer.sampling_params import SamplingParams


@dataclass(frozen=True)
class StreamFailure:
    """Put on a request's sink instead of further deltas when the request cannot go on."""

    request_id: str
    error: BaseException
    # Like a delta's flag: nothing follows it. A consumer of many requests checks
    # ``event.finished`` on every event and tells failures apart only then.
    finished: ClassVar[bool] = True


# ---------------------------------------------------------------------- front -> core
@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt: np.ndarray  # token ids, checked (`PromptChecker.token_ids`)
    params: SamplingParams
    cache_salt: Hashable


@dataclass(slots=True)
class Abort:
    request_id: str  # a request that has finished already is ignored


@dataclass(slots=True)
class Call:
    call_id: int
    fn: Callable[[LLM], Any]  # run between two steps; in an engine process it must pickle


@dataclass(slots=True)
class Close:
    """Abort every open request, report them, and stop."""


CoreInput = AddRequest | Abort | Call | Close


# ---------------------------------------------------------------------- core -> front
@dataclass(slots=True)
class CallResult:
    call_id: int
    value: Any
    error: BaseException | None


@dataclass(slots=True)
class StepOutput:
    """Everything one pass of the loop has for the front. ``num_taken`` counts the `AddRequest`s the
    core has taken so far, ``num_waiting`` the engine's requests queued for admission after the
    step: the front's waiting count is ``submitted - num_taken + num_waiting``."""

    events: list[EngineEvent | StreamFailure]
    results: list[CallResult]
    num_taken: int
    num_waiting: int


@dataclass(frozen=True)
class CoreReady:
    """An engine process has built its `LLM`: what its front needs to check prompts."""

    prompts: PromptChecker


@dataclass(frozen=True)
class CoreFailed:
    """The loop has ended on ``error`` (or its engine process has died); nothing follows."""

    error: BaseException


CoreOutput = StepOutput | CoreReady | CoreFailed


class CoreChannel(Protocol):
    """The core's end of a channel."""

    def take(self, block: bool) -> list[CoreInput]:
        """Every message the front has sent since the last call, in order; with ``block``, waits
        for at least one. A front that has gone away reads as a `Close`."""
        ...

    def emit(self, output: CoreOutput) -> None:
        """Hand ``output`` to the front without waiting for it to be read."""
        ...


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


@dataclass(frozen=True)
class EngineProcess:
    """An `LLM` that an engine process of its own builds and steps: `LLM`'s keyword arguments, which
    must pickle (a preset name or checkpoint dir, not a config object holding weights)."""

    llm_kwargs: dict[str, Any]

    def __init__(self, **llm_kwargs: Any) -> None:
        object.__setattr__(self, "llm_kwargs", llm_kwargs)


class _PipeEnd:
    """One end of the duplex pipe: `send` pickles on the calling thread (what does not pickle fails
    there) and a sender thread writes; `recv` reads one message. Sends after the other end has gone
    are dropped: the reading side learns of it through ``EOFError``."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name=name, daemon=True)
        self._sender.start()

    def send(self, message: object) -> None:
        self._outbox.put(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())

    def close(self) -> None:
        """Write what is queued, then close the pipe."""
        self._outbox.put(None)
        self._sender.join()
        self.conn.close()

    def _send_all(self) -> None:
        while (payload := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(payload)
            except OSError:  # the other end has gone: drop the rest
                return


class _CoreEnd:
    """The engine process's end of the channel (`CoreChannel`)."""

    def __init__(self, pipe: _PipeEnd) -> None:
        self._pipe = pipe

    def take(self, block: bool) -> list[CoreInput]:
        conn = self._pipe.conn
        try:
            messages = [self._pipe.recv()] if block else []
            while conn.poll():
                messages.append(self._pipe.recv())
        except (EOFError, OSError):
            return [Close()]  # the front has gone
        return messages

    def emit(self, output: CoreOutput) -> None:
        try:
            self._pipe.send(output)
        except Exception as exc:  # noqa: BLE001 - a result or error that does not pickle
            self._pipe.send(_picklable(output, exc))


def _picklable(output: CoreOutput, exc: Exception) -> CoreOutput:
    """``output`` with what did not pickle replaced by an error saying so."""
    if isinstance(output, StepOutput):
        results = []
        for result in output.results:
            try:
                pickle.dumps(result)
            except Exception as error:  # noqa: BLE001
                result = CallResult(result.call_id, None, TypeError(f"does not pickle: {error}"))
            results.append(result)
        return StepOutput(output.events, results, output.num_taken, output.num_waiting)
    return CoreFailed(RuntimeError(f"{output!r} (which does not pickle: {exc})"))


def _engine_process_main(
    conn: Connection, llm_kwargs: dict[str, Any], gc_threshold: tuple[int, int, int]
) -> None:
    """The engine process: build the `LLM`, report `CoreReady` (or `CoreFailed`), serve."""
    # Stopped by its front (a `Close`, or the pipe closing), not by the terminal's Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.set_threshold(*gc_threshold)
    pipe = _PipeEnd(conn, "radixinfer-engine-sender")
    channel = _CoreEnd(pipe)
    try:
        llm = LLM(**llm_kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the front, which raises it
        channel.emit(CoreFailed(exc))
    else:
        channel.emit(CoreReady(llm.engine.prompts))
        EngineCore(llm).run(channel)
    pipe.close()


class ProcessCore:
    """An `EngineCore` in an engine process of its own (multiprocessing's spawn context, a daemon,
    named ``radixinfer-engine``). The constructor returns once the process has built its `LLM`, and
    raises what building it raised (a ``ValueError`` for a configuration that cannot fit) or
    ``RuntimeError`` if the process dies first. A reader thread hands each output to
    ``on_output``; when the process dies, it hands over a `CoreFailed`. The process copies this
    process's garbage-collector thresholds."""

    def __init__(self, spec: EngineProcess, on_output: Callable[[CoreOutput], None]) -> None:
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_engine_process_main,
            args=(child_conn, spec.llm_kwargs, gc.get_threshold()),
            name="radixinfer-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        self._pipe = _PipeEnd(conn, "radixinfer-engine-writer")
        try:
            self.prompts = self._wait_ready()
        except BaseException:
            self._kill()
            self._pipe.close()
            raise
        self._on_output = on_output
        self._reader = threading.Thread(
            target=self._read_all, name="radixinfer-engine-reader", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def send(self, message: CoreInput) -> None:
        """Queue ``message`` for the engine process; raises what pickling it raises."""
        self._pipe.send(message)

    def join(self) -> None:
        """Wait for the process to end (after a `Close`) and for its last outputs to be handed
        over; a process that has not ended within 30 s is killed."""
        self._process.join(timeout=30)
        self._kill()
        self._reader.join(timeout=30)
        self._pipe.close()

    def _wait_ready(self) -> PromptChecker:
        try:
            output = self._pipe.recv()
        except (EOFError, OSError):
            self._process.join(timeout=10)
            raise RuntimeError(
                f"the engine process exited with code {self._process.exitcode} while starting"
            ) from None
        if isinstance(output, CoreFailed):
            raise output.error
        return output.prompts

    def _read_all(self) -> None:
        try:
            while True:
                output = self._pipe.recv()
                self._on_output(output)
                if isinstance(output, CoreFailed):
                    return
        except (EOFError, OSError):
            self._process.join(timeout=5)
            code = self._process.exitcode
            error: BaseException = RuntimeError(f"the engine process exited (code {code})")
        except Exception as exc:  # noqa: BLE001 - an output the front could not take
            error = exc  # nothing after it can be trusted: stop the engine, fail every caller
            self._kill()
        self._on_output(CoreFailed(error))

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
