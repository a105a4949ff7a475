"""The engine process: `EngineProcess` names an `LLM` to build in a process of its own, and
`ProcessCore` runs the engine core's loop (`radixinfer.engine_core.EngineCore`) there, so the
engine never shares a GIL with the front's event loop (an HTTP server streaming hundreds of
requests).

The process starts in multiprocessing's spawn context; messages (`radixinfer.core_messages`) are
pickled over one duplex pipe per front: one, or with ``radixinfer serve --api-server-count N``, one
per API server process (`start_engine_process`, `EngineConnection`), each request's outputs going
back over the pipe it came by. Each end of the pipe writes a message's frame from the thread that
sends it, without blocking, and hands what the socket cannot take at once to a writer thread: a slow
reader never stalls a step, nor a busy engine the front's event loop, and in the usual case no other
thread wakes. Threads cost here: a thread that has done a pipe read or write must take the GIL back
before its next one, and while another thread is busy that waits up to the interpreter's switch
interval (5 ms). The engine watches every front's pipe with one selector: one syscall a take,
where a poll per pipe gave eight chances a step to wait for the GIL behind a writer thread (taking
nothing took 0.19 ms a decode step, median, against 0.011 ms since: 512 streams over eight API
servers, `bench_serve.py --step-trace`, an H200). The reader reads whatever the pipe holds at
once (up to 1 MiB) and splits it into frames itself: ``Connection.recv_bytes`` reads a frame's
header and its body with two reads, each of which gives up the GIL and waits to take it back while
the front's event loop is busy
(``benchmarks/pipe_read_lag.py``, 230 frames a second beside a spinning thread, on a 2-core CPU: a
p99 lag of 90-190 ms, against 13-42 ms read at once). An engine process that dies (killed, crashed)
closes its end of the pipe, which the front's reader turns into `CoreFailed`. The other way round,
an engine process ends when its last front has closed its pipe, and at once when the process that
started it exits, however it exits (`radixinfer.lifetime.exit_with_parent`).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from radixinfer.api import LLM
from radixinfer.core_messages import (
    Abort,
    AddRequest,
    Call,
    CallResult,
    Close,
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreReady,
    EventSplitter,
    StepOutput,
)
from radixinfer.engine.prompts import PromptChecker
from radixinfer.engine.runner_setup import inline_host_ops
from radixinfer.engine_core import EngineCore, StepTrace
from radixinfer.lifetime import exit_with_parent


@dataclass(frozen=True)
class EngineProcess:
    """An `LLM` that an engine process of its own builds and steps: `LLM`'s keyword arguments, which
    must pickle (a preset name or checkpoint dir, not a config object holding weights).
    ``environment``: variables the engine process starts with beside this process's (a
    data-parallel replica's ``CUDA_VISIBLE_DEVICES``: its GPUs)."""

    llm_kwargs: dict[str, Any]
    environment: dict[str, str]

    def __init__(self, *, environment: dict[str, str] | None = None, **llm_kwargs: Any) -> None:
        object.__setattr__(self, "llm_kwargs", llm_kwargs)
        object.__setattr__(self, "environment", dict(environment or {}))


# ``Connection.send_bytes``'s framing: a frame's size, big-endian; -1 and then the size as 8 bytes
# for a frame of 2 GiB or more
_SIZE = struct.Struct("!i")
_LONG_SIZE = struct.Struct("!Q")
_READ_BYTES = 1 << 20


def _frame(messages: list[Any]) -> bytes:
    """``messages`` as one frame: ``Connection.send_bytes``'s size header, then their pickled list."""
    body = pickle.dumps(messages, pickle.HIGHEST_PROTOCOL)
    if len(body) < 1 << 31:
        return _SIZE.pack(len(body)) + body
    return _SIZE.pack(-1) + _LONG_SIZE.pack(len(body)) + body


class _PipeEnd:
    """One end of the duplex pipe (a Unix socket pair).

    `send` pickles a message on the calling thread (what does not pickle fails there) and writes its
    frame at once without blocking when nothing is queued before it: a step's outputs leave the
    engine's thread with a few syscalls and wake no other thread. What the socket cannot take at
    once (a reader that is behind) is queued, with every later frame, for the writer thread, which
    writes all that is queued in one blocking write; so frames go out in the order sent, and a slow
    reader never stalls a step. Sends after the other end has gone are dropped: the reading side
    learns of it through ``EOFError``.

    `recv` returns one frame's messages, reading everything the pipe holds at once and splitting it
    into frames here; `fill` without waiting (all the pipe holds now) and `has_frame` serve a caller
    that watches several pipes with one selector."""

    def __init__(self, conn: Connection, name: str) -> None:
        # ``conn``'s socket as a socket (for the non-blocking flag of `socket.send`, per call: the
        # file stays blocking); ``conn`` itself is closed, this end owns the pipe from here
        self._socket = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        self._received = bytearray()  # what was read and is not a whole frame yet
        self._frames: deque[bytes] = deque()
        self._lock = threading.Condition()
        self._queued: list[bytes] = []  # frames (or their unwritten rest) for the writer thread
        self._writing = False  # the writer thread owns the socket's writes until the queue is empty
        self._closing = False
        self._gone = False  # the other end has gone: sends are dropped
        self._writer = threading.Thread(target=self._write_queued, name=name, daemon=True)
        self._writer.start()

    def send(self, message: object) -> None:
        data = _frame([message])
        with self._lock:
            if self._gone:
                return
            if not self._writing:
                try:
                    sent = self._socket.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._gone = True
                    return
                if sent == len(data):
                    return
                data = data[sent:]
                self._writing = True
            self._queued.append(data)
            self._lock.notify()

    def recv(self) -> list[Any]:
        """The messages of the next frame, in the order sent (blocks until one comes; ``EOFError``
        once the other end has closed)."""
        while not self._frames:
            self.fill()
        return pickle.loads(self._frames.popleft())

    def fileno(self) -> int:
        """The pipe's file descriptor, for a selector."""
        return self._socket.fileno()

    def has_frame(self) -> bool:
        """Whether a whole frame has arrived (`recv` would not wait)."""
        return bool(self._frames)

    def fill(self, wait: bool = True) -> None:
        """Read from the pipe and keep its whole frames: with ``wait``, one read, which waits for
        something to come; without, until the pipe holds nothing (perhaps at once): a writer
        refills it while it is read, and a burst of requests far larger than the socket's buffer
        must reach the engine in one take, not a buffer's worth a step."""
        flags = 0 if wait else socket.MSG_DONTWAIT
        while True:
            try:
                data = self._socket.recv(_READ_BYTES, flags)
            except BlockingIOError:  # nothing more now
                return
            if not data:
                raise EOFError
            self._split(data)
            if wait:
                return

    def _split(self, data: bytes) -> None:
        """Append ``data`` to what was read and move its whole frames to the frame queue."""
        received = self._received
        received += data
        at = 0
        while len(received) - at >= _SIZE.size:
            (size,) = _SIZE.unpack_from(received, at)
            start = at + _SIZE.size
            if size == -1:
                if len(received) - start < _LONG_SIZE.size:
                    break
                (size,) = _LONG_SIZE.unpack_from(received, start)
                start += _LONG_SIZE.size
            if len(received) - start < size:
                break
            self._frames.append(bytes(received[start : start + size]))
            at = start + size
        del received[:at]

    def close(self) -> None:
        """Write what is queued (unless the other end has gone), then close the pipe."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._writer.join()
        self._socket.close()

    def _write_queued(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._closing:
                    self._lock.wait()
                if not self._queued:  # closing, and everything sent
                    return
                data, self._queued = b"".join(self._queued), []
            try:
                self._socket.sendall(data)
            except OSError:  # the other end has gone: drop the rest
                with self._lock:
                    self._gone, self._queued = True, []
                return
            with self._lock:
                self._writing = bool(self._queued)


class _CoreEnd:
    """The engine process's end of its channels (`CoreChannel`): one pipe per front (``radixinfer
    serve --api-server-count N`` runs N fronts, one per API server process, over one engine).

    Messages of every front are taken together. Each front names its requests itself, and no two
    fronts share a name (`EngineConnection.front`), so a request's events go back to the front that
    sent it; call ids, which every front counts from 0, are renamed on the way in and back. A
    `StepOutput` reaches a front when it has events or results for it, or when its counts changed
    (``num_taken``: the front's own requests taken; ``num_waiting``: the engine's, which every front
    shares). A front that sends `Close` or goes away has its requests aborted; the engine stops
    (`Close`) when the last front has."""

    def __init__(self, pipes: list[_PipeEnd]) -> None:
        self._pipes = dict(enumerate(pipes))  # the open fronts' pipes, by front index
        # which open fronts have sent something: one syscall a take, however many fronts
        self._selector = selectors.DefaultSelector()
        for front, pipe in self._pipes.items():
            self._selector.register(pipe, selectors.EVENT_READ, front)
        self._one_front = len(pipes) == 1  # every request its own: no owners, no splitting
        self._closing: list[int] = []  # fronts that sent `Close`: their pipe closes next take
        self._owners: dict[str, int] = {}  # open request id -> front
        self._splitter = EventSplitter()
        self._calls: dict[int, tuple[int, int]] = {}  # engine call id -> (front, its call id)
        self._call_ids = itertools.count()
        self._taken = [0] * len(pipes)
        self._reported: list[tuple[int, int] | None] = [None] * len(pipes)

    def take(self, block: bool) -> list[CoreInput]:
        messages: list[CoreInput] = []
        wait = False  # for a front's message: nothing came, and ``block``
        while True:
            # Fronts that sent `Close`: what they were owed is queued already (`close` sends it).
            for front in self._closing:
                if front in self._pipes:  # (not if it has gone since)
                    self._forget(front).close()
            self._closing = []
            if not self._pipes:
                return [*messages, Close()]
            ready = self._selector.select(timeout=None if wait else 0)
            readable = {key.data for key, _ in ready}
            for front, pipe in list(self._pipes.items()):
                gone = False
                if front in readable:
                    try:
                        pipe.fill(wait=False)
                    except (EOFError, OSError):  # the front has gone, after what it sent
                        gone = True
                while pipe.has_frame():
                    messages += self._adopt(front, pipe.recv())
                if gone:
                    self._forget(front)
                    messages += self._aborts(front)
            if messages or not block:
                return messages
            # Waiting needs a front still open: with none left, the loop's top ends the engine;
            # fronts that sent `Close` are owed nothing more, so they are closed first.
            wait = bool(self._pipes) and not self._closing

    def _forget(self, front: int) -> _PipeEnd:
        """Stop watching ``front``'s pipe (it has gone, or closes next) and return it."""
        pipe = self._pipes.pop(front)
        self._selector.unregister(pipe)
        return pipe

    def _adopt(self, front: int, messages: list[CoreInput]) -> list[CoreInput]:
        """``front``'s messages as the engine core takes them."""
        adopted: list[CoreInput] = []
        for message in messages:
            kind = type(message)
            if kind is AddRequest:
                if not self._one_front:
                    self._owners[message.request_id] = front
                self._taken[front] += 1
            elif kind is Call:
                call_id = next(self._call_ids)
                self._calls[call_id] = (front, message.call_id)
                message.call_id = call_id
            elif kind is Close and len(self._pipes) > 1:  # the others go on
                self._closing.append(front)
                adopted += self._aborts(front)
                continue
            adopted.append(message)
        return adopted

    def _aborts(self, front: int) -> list[CoreInput]:
        return [Abort(request_id) for request_id, f in self._owners.items() if f == front]

    def emit(self, output: CoreOutput) -> None:
        if type(output) is not StepOutput:
            for pipe in self._pipes.values():
                self._send(pipe, output)
            return
        if self._one_front:
            per_front = {0: output.events} if output.events else {}
        else:
            per_front = self._splitter.split(output.events, self._owners)
        results: dict[int, list[CallResult]] = {}
        for result in output.results:
            front, result.call_id = self._calls.pop(result.call_id)
            results.setdefault(front, []).append(result)
        for front, pipe in self._pipes.items():
            counts = (self._taken[front], output.num_waiting)
            events, front_results = per_front.get(front, []), results.get(front, [])
            if events or front_results or counts != self._reported[front]:
                self._reported[front] = counts
                self._send(pipe, StepOutput(events, front_results, *counts))

    @staticmethod
    def _send(pipe: _PipeEnd, output: CoreOutput) -> None:
        try:
            pipe.send(output)
        except Exception as exc:  # noqa: BLE001 - a result or error that does not pickle
            pipe.send(_picklable(output, exc))

    def close(self) -> None:
        """Write what is queued to every front still open, then close the pipes."""
        for front in list(self._pipes):
            self._forget(front).close()
        self._selector.close()


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


ENGINE_PROCESS_NAME = "radixinfer-core"


def name_this_process(name: str) -> None:
    """Show ``name`` (at most 15 characters, Linux's limit) as this process's name where ``top`` and
    ``ps -o comm`` look (Linux; elsewhere nothing changes): the engine process and each API server
    process of ``radixinfer serve`` name themselves, so their CPU can be told apart."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:15])


def named_children(pid: int) -> dict[str, int]:
    """The child processes of process ``pid`` by name (what `name_this_process` set; others by their
    program's name), read from Linux's ``/proc`` ({} elsewhere, or once ``pid`` has gone)."""
    named = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    named[Path(f"/proc/{child}/comm").read_text().strip()] = int(child)
    return named


def _engine_process_main(
    conns: list[Connection], llm_kwargs: dict[str, Any], gc_threshold: tuple[int, int, int]
) -> None:
    """The engine process: build the `LLM`, report `CoreReady` (or `CoreFailed`) to every front,
    serve them."""
    exit_with_parent()  # ends with its fronts' process, even killed (and its TP workers with it)
    # Stopped by its fronts (a `Close`, or the pipes closing), not by the terminal's Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_this_process(ENGINE_PROCESS_NAME)
    gc.set_threshold(*gc_threshold)
    # multiprocessing refuses children to a daemon, but a tensor-parallel engine starts its workers
    # (daemons themselves: they end with this process, which its parent still ends as a daemon).
    # The flag is private; the assertion that reads it is the only thing it changes here.
    multiprocessing.current_process()._config["daemon"] = False
    channel = _CoreEnd([_PipeEnd(conn, "radixinfer-engine-sender") for conn in conns])
    try:
        llm = LLM(**llm_kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the fronts, which raise it
        channel.emit(CoreFailed(exc))
        channel.close()
        sys.exit(1)
    inline_host_ops(llm.engine.runner.device)
    channel.emit(CoreReady(llm.engine.prompts))
    EngineCore(llm, StepTrace.from_environment("engine-process")).run(channel)
    channel.close()


@dataclass(frozen=True)
class EngineConnection:
    """A front's connection to an engine process that another process started and owns
    (`start_engine_process`; ``radixinfer serve --api-server-count N`` hands one to each API server
    process): `radixinfer.AsyncLLM` takes it in place of an `EngineProcess`. ``front`` is this
    connection's index among the engine's; the front's request ids carry it, so no two fronts name
    a request alike. ``pid``: the engine process's id."""

    conn: Connection
    front: int
    pid: int | None


def start_engine_process(
    spec: EngineProcess, num_fronts: int
) -> tuple[BaseProcess, list[EngineConnection]]:
    """Start ``spec``'s engine process (multiprocessing's spawn context, a daemon, named
    ``radixinfer-engine``) serving ``num_fronts`` fronts, and return it with one connection per
    front. It starts loading at once; each front learns that it is ready (or what failed) through
    its connection. The process ends when every front has closed or gone, or this process has
    exited; its owner should ``join`` it then (and ``kill`` it if it does not end)."""
    if num_fronts < 1:
        raise ValueError(f"num_fronts must be >= 1, got {num_fronts}")
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(num_fronts)]
    process = context.Process(
        target=_engine_process_main,
        args=([child for _, child in pipes], spec.llm_kwargs, gc.get_threshold()),
        name="radixinfer-engine",
        daemon=True,
    )
    with _spawning(spec.environment):
        process.start()
    for _, child in pipes:
        child.close()
    return process, [EngineConnection(conn, i, process.pid) for i, (conn, _) in enumerate(pipes)]


_SPAWN_LOCK = threading.Lock()


@contextlib.contextmanager
def _spawning(environment: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``environment`` set, while a process is spawned (a spawned
    process copies its parent's environment when it starts); one spawn at a time."""
    with _SPAWN_LOCK:
        saved = {name: os.environ.get(name) for name in environment}
        os.environ.update(environment)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


class ProcessCore:
    """An `EngineCore` in an engine process: its own (``spec`` an `EngineProcess`, started here and
    stopped by `join`), or one another process owns (``spec`` an `EngineConnection`; `join` waits
    for the engine to close this connection). The constructor returns once the engine has built its
    `LLM`, and raises what building it raised (a ``ValueError`` for a configuration that cannot
    fit) or ``RuntimeError`` if the process dies first. A reader thread hands each output to
    ``on_output``; when the process dies (or closes this connection), it hands over a `CoreFailed`.
    A process started here copies this process's garbage-collector thresholds."""

    def __init__(
        self, spec: EngineProcess | EngineConnection, on_output: Callable[[CoreOutput], None]
    ) -> None:
        if isinstance(spec, EngineProcess):
            self._process: BaseProcess | None
            self._process, (connection,) = start_engine_process(spec, 1)
        else:
            self._process, connection = None, spec
        self.pid = connection.pid
        self.request_prefix = f"req-{connection.front}-" if self._process is None else "req-"
        self._pipe = _PipeEnd(connection.conn, "radixinfer-engine-writer")
        self._early: list[CoreOutput] = []  # what came in the frame of `CoreReady`, after it
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

    def send(self, message: CoreInput) -> None:
        """Queue ``message`` for the engine process; raises what pickling it raises."""
        self._pipe.send(message)

    def join(self) -> None:
        """Wait for the engine to end this connection (after a `Close`: its process ends, or, when
        other fronts remain, closes this connection) and for its last outputs to be handed over; a
        process of this front's that has not ended within 30 s is killed."""
        if self._process is not None:
            self._process.join(timeout=30)
            self._kill()
        self._reader.join(timeout=30)
        self._pipe.close()

    def _gone(self) -> str:
        """How the engine went away, for the error its front reports."""
        if self._process is None:
            return "the engine process closed this front's connection"
        self._process.join(timeout=10)
        return f"the engine process exited with code {self._process.exitcode}"

    def _wait_ready(self) -> PromptChecker:
        try:
            output, *self._early = self._pipe.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"{self._gone()} while starting") from None
        if isinstance(output, CoreFailed):
            raise output.error
        return output.prompts

    def _read_all(self) -> None:
        try:
            outputs, self._early = self._early, []
            while True:
                for output in outputs:
                    self._on_output(output)
                    if isinstance(output, CoreFailed):
                        return
                outputs = self._pipe.recv()
        except (EOFError, OSError):
            error: BaseException = RuntimeError(self._gone())
        except Exception as exc:  # noqa: BLE001 - an output the front could not take
            error = exc  # nothing after it can be trusted: stop the engine, fail every caller
            self._kill()
        self._on_output(CoreFailed(error))

    def _kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
