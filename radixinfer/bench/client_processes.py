"""``radixinfer bench --backend openai --client-processes K``: the workload's streams read by K
client processes, so that one process's reading (~70,000 one-token chunks a second) does not cap
what the bench measures of a server that streams faster::

    bench process                         client process i < K (its own `OpenAIBackend`)
    sessions i, i + K, i + 2K, ... ---->  run_workload on its share, prompts ready
                                   <----  ready
    one start time for all          ---->  submits at start + each session's offset
                                   <----  its records (every token's perf_counter time)

Each session (all its turns) runs in one process, at the offset it has in the whole workload, from
a start time every process shares: ``time.perf_counter`` reads the same monotonic clock in every
process of a Linux machine, so the records merge as they are, and TTFT, ITL and throughput are
taken over every request as if one process had run them all.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from radixinfer.bench.metrics import RequestRecord
from radixinfer.bench.run_loop import run_workload, wall_time
from radixinfer.bench.workloads import Session
from radixinfer.lifetime import exit_with_parent

_START_LEAD_SECONDS = 0.05  # from the start message to the start time: every process has read it


class ClientProcesses:
    """``count`` client processes (multiprocessing's spawn context), each with an `OpenAIBackend`
    to ``base_url`` serving ``model``, open until `close`. The constructor returns once every
    process has connected (a server that does not answer raises ``RuntimeError``)."""

    def __init__(self, base_url: str, model: str, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        context = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes: list[BaseProcess] = []
        for i in range(count):
            conn, child = context.Pipe()
            process = context.Process(
                target=_client_main,
                args=(child, base_url, model),
                name=f"radixinfer-bench-client-{i}",
                daemon=True,
            )
            process.start()
            child.close()
            self._conns.append(conn)
            self._processes.append(process)
        try:
            self._receive_all(self._conns)  # each has opened its backend
        except BaseException:
            self.close()
            raise

    def run(
        self, sessions: list[Session], offsets: list[float], args: argparse.Namespace, desc: str
    ) -> tuple[list[RequestRecord], float]:
        """`run_workload` over ``sessions`` (session j in process j mod ``count``, at offset
        ``offsets[j]``) across the processes: every record, and the wall time from the first
        submit to the last token of all of them. A failed request raises ``RuntimeError``."""
        count = len(self._conns)
        shares = [(conn, range(i, len(sessions), count)) for i, conn in enumerate(self._conns)]
        shares = [(conn, share) for conn, share in shares if share]  # fewer sessions than processes
        busy = [conn for conn, _ in shares]
        for i, (conn, share) in enumerate(shares):
            work = ([sessions[j] for j in share], [offsets[j] for j in share], args, desc, i == 0)
            conn.send(work)
        self._receive_all(busy)  # their prompts are ready
        start = time.perf_counter() + _START_LEAD_SECONDS
        for conn in busy:
            conn.send(start)
        records = [record for share in self._receive_all(busy) for record in share]
        return records, wall_time(records)

    def close(self) -> None:
        """Stop the processes (each closes its backend). Idempotent."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:  # it has gone already
                pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._processes = [], []

    def _receive_all(self, conns: list[Connection]) -> list:
        """One answer from each of ``conns``, in order; raises what a process reports, or
        ``RuntimeError`` when one has died."""
        answers = []
        for conn in conns:
            process = self._processes[self._conns.index(conn)]
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                process.join(timeout=10)
                raise RuntimeError(f"{process.name} exited with code {process.exitcode}") from None
            if kind == "error":
                raise RuntimeError(f"{process.name}: {value}")
            answers.append(value)
        return answers


def _client_main(conn: Connection, base_url: str, model: str) -> None:
    """A client process: open the backend, then run each share of a workload sent, until None (or
    until the bench process has gone, `exit_with_parent`)."""
    exit_with_parent()
    from radixinfer.bench.openai_backend import OpenAIBackend

    try:
        backend = OpenAIBackend(base_url, model)
    except Exception as exc:  # noqa: BLE001 - reported to the bench process
        conn.send(("error", repr(exc)))
        return
    conn.send(("ok", None))

    def start() -> float:  # prompts ready: say so, and wait for the shared start time
        conn.send(("ok", None))
        return conn.recv()

    try:
        while (work := conn.recv()) is not None:
            sessions, offsets, args, desc, progress = work
            if args.gc_threshold:  # as the bench process runs (`radixinfer.bench.runner`)
                gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
            gc.collect()
            gc.freeze()
            try:
                records, _ = run_workload(
                    backend, sessions, offsets, args, desc, start=start, progress=progress
                )
            except Exception as exc:  # noqa: BLE001 - reported to the bench process
                conn.send(("error", repr(exc)))
                return
            conn.send(("ok", records))
    except EOFError:  # the bench process has gone
        pass
    finally:
        backend.close()
