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

With ``RADIXINFER_STEP_TRACE`` set to a folder, every core writes a line per step there
(`StepTrace`), to see where a run's time goes on the engine's side
(``benchmarks/bench_serve.py --step-trace``).
"""

from __future__ import annotations

import itertools
import os
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path

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
from radixinfer.gc_pauses import GCPauses
from radixinfer.outputs import EngineEvent

STEP_TRACE_ENV = "RADIXINFER_STEP_TRACE"  # a folder: every engine core writes its steps there
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux: one thread's usage


class StepTrace:
    """A line per engine step in ``folder/{label}-{pid}-{k}.steps`` (the process's k-th trace),
    with a header naming the `FIELDS`:
    when the core began taking the front's messages, when the step began and ended
    (``time.perf_counter`` seconds, one clock for every process of a machine), whether the take
    waited for work (the engine had none: a new burst begins), the requests it took, the engine's
    waiting and active requests after the step, the prompt tokens the step computed and the events
    it emitted; then, over the step, the CPU seconds the core's thread ran (``cpu``; on a GPU a wait
    for the device spins, so it counts here, while a wait for the GIL or for a free core does not),
    the seconds the process's garbage collector paused every thread (``gc``), and how often the
    kernel took the CPU from the thread for another (``preempted``, Linux; 0 elsewhere). Lines are
    written as they come (a core in a process that is killed loses none)."""

    FIELDS = (
        "take", "start", "end", "idle", "added", "waiting", "active", "computed", "events",
        "cpu", "gc", "preempted",
    )  # fmt: skip
    _opened = itertools.count()  # the traces this process has opened

    def __init__(self, folder: str | Path, label: str) -> None:
        self.path = Path(folder) / f"{label}-{os.getpid()}-{next(self._opened)}.steps"
        self._file = self.path.open("w", buffering=1)
        self._file.write(" ".join(self.FIELDS) + "\n")
        self._gc = GCPauses().start()  # while this trace is open

    def counters(self) -> tuple[float, float, int]:
        """The calling thread's CPU seconds, the collector's pause seconds and the calling thread's
        involuntary context switches, so far: the core records their growth over each step."""
        switches = resource.getrusage(_RUSAGE_THREAD).ru_nivcsw if _RUSAGE_THREAD else 0
        return time.thread_time(), self._gc.total_s, switches

    @classmethod
    def from_environment(cls, label: str) -> StepTrace | None:
        """A trace in the folder `STEP_TRACE_ENV` names, or None when it is not set."""
        folder = os.environ.get(STEP_TRACE_ENV)
        return cls(folder, label) if folder else None

    def record(self, *values: float) -> None:
        """One step's `FIELDS`, in order."""
        self._file.write(" ".join(map(repr, values)) + "\n")

    def close(self) -> None:
        self._gc.stop()
        self._file.close()

    @staticmethod
    def read(path: str | Path) -> list[dict[str, float]]:
        """The steps a trace file holds, in order, each its `FIELDS` by name."""
        header, *lines = Path(path).read_text().splitlines()
        fields = header.split()
        return [dict(zip(fields, map(float, line.split()))) for line in lines]


class EngineCore:
    """The loop over ``llm``'s engine: applies the front's messages between two steps, in the order
    sent, steps while the engine has work, and emits one `StepOutput` a pass when there is news.
    Finished requests are forgotten by the engine (``pop_finished``) before their events leave.
    ``trace``: where each step is recorded, if anywhere."""

    def __init__(self, llm: LLM, trace: StepTrace | None = None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self._num_taken = 0
        self._reported = (0, 0)  # (num_taken, num_waiting) as last emitted
        self._trace = trace

    def run(self, channel: CoreChannel) -> None:
        """Serve until a `Close` (every open request aborted first) or until the front is gone; an
        exception ends the loop with a `CoreFailed`."""
        try:
            while self._serve_once(channel):
                pass
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the front
            channel.emit(CoreFailed(exc))
        finally:
            if self._trace is not None:
                self._trace.close()

    def _serve_once(self, channel: CoreChannel) -> bool:
        engine = self.engine
        events: list[EngineEvent | StreamFailure] = []
        results: list[CallResult] = []
        closing = False
        idle = not engine.has_unfinished()  # the take waits for work
        trace = self._trace
        if trace is not None:
            taking, taken = time.perf_counter(), self._num_taken
            computed = engine.counters.computed_prompt_tokens
        for message in channel.take(block=idle):
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
            if trace is not None:
                before = trace.counters()
                started = time.perf_counter()
            events += engine.step()
            if trace is not None:
                ended = time.perf_counter()
                scheduler = engine.scheduler
                trace.record(
                    taking, started, ended, int(idle), self._num_taken - taken,
                    len(scheduler.waiting), len(scheduler.active),
                    engine.counters.computed_prompt_tokens - computed, len(events),
                    *(after - was for after, was in zip(trace.counters(), before)),
                )  # fmt: skip
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
        core = EngineCore(llm, StepTrace.from_environment("engine-thread"))
        self._thread = threading.Thread(
            target=core.run, args=(self,), name="radixinfer-engine", daemon=False
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
