"""``radixinfer serve --api-server-count N`` with N > 1: N API server processes over one engine
process, so the HTTP side (parsing, streaming, detokenizing) is not one process's event loop::

    radixinfer serve           binds a socket per API server, starts the others, watches them
    ├── radixinfer-core        the engine process: one `EngineCore`, one pipe per API server
    │                          (`start_engine_process`)
    └── radixinfer-api0 .. N-1 API server i: uvicorn + the app + an `AsyncLLM` over pipe i
                               (`EngineConnection`), accepting connections on socket i

(the names are what ``top`` and ``ps -o comm`` show, `name_this_process`).

Every API server listens on a socket of its own bound to the server's port (``SO_REUSEPORT``), so
the kernel hashes each connection to one of them: a burst of connections spreads evenly over the
processes, whichever of them is busy when it arrives (`radixinfer.server.launch.bind_sockets`).
Each names its requests with its own prefix, and the engine sends a request's outputs back over the
pipe it came by. The per-request metrics live in a shared table, a row per API server
(`shared_metrics_table`), so any server's ``/metrics`` reports the whole server; the engine's
numbers, ``/health`` and ``/reset_prefix_cache`` go to the one engine. ``--max-waiting`` bounds the
engine's waiting queue, which every API server counts in full (plus its own requests still on their
way to the engine, so the server as a whole admits at most N x the requests in flight on a pipe more).

When any of these processes exits, the others are stopped and ``radixinfer serve`` exits, with an
error when that process failed: a dead API server or engine never leaves the server half up.
SIGINT (the terminal's Ctrl-C reaches every process) and SIGTERM (sent to this process, which passes
it on) stop the API servers gracefully; the engine ends when its last API server has gone. Killed
by SIGKILL, this process cleans nothing up, but the engine and the API servers exit with it
(`radixinfer.lifetime.exit_with_parent`), so no server is left accepting on the port.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import signal
import socket
from multiprocessing.process import BaseProcess
from typing import Any

from radixinfer.engine_args import llm_kwargs
from radixinfer.engine_process import (
    EngineConnection,
    EngineProcess,
    name_this_process,
    start_engine_process,
)
from radixinfer.lifetime import exit_with_parent
from radixinfer.server.app import ServerConfig
from radixinfer.server.metrics import shared_metrics_table

API_SERVER_PROCESS_NAME = "radixinfer-api"  # API server i names itself this and i
_GRACE_SECONDS = 10  # what an API server gets to finish its streams before it is killed
_SAY_WHY_SECONDS = 2  # what the others get to end on their own after one has exited


class _Stop(Exception):
    """This process got SIGTERM."""


def run_api_servers(
    args: argparse.Namespace, config: ServerConfig, sockets: list[socket.socket]
) -> None:
    """Serve ``radixinfer serve``'s ``args`` with ``args.api_server_count`` API server processes,
    process i on ``sockets[i]`` (`radixinfer.server.launch.bind_sockets`: bound to one port, not yet
    listening), until interrupted or until one of the processes exits; raises ``SystemExit`` naming
    a process that failed."""
    count = args.api_server_count
    table = shared_metrics_table(count)
    engine, connections = start_engine_process(EngineProcess(**llm_kwargs(args)), count)
    context = multiprocessing.get_context("spawn")
    servers = [
        context.Process(
            target=_api_server_main,
            args=(args, config, connection, sock, table),
            name=f"radixinfer-api-server-{connection.front}",
            daemon=True,
        )
        for connection, sock in zip(connections, sockets)
    ]
    for server in servers:
        server.start()
    for connection in connections:  # theirs now: a server that dies closes its pipe
        connection.conn.close()
    failed = _watch(engine, servers)
    if failed is not None:
        raise SystemExit(f"radixinfer serve: {failed.name} exited with code {failed.exitcode}")


def _watch(engine: BaseProcess, servers: list[BaseProcess]) -> BaseProcess | None:
    """Wait until a process exits or this one is told to stop, then stop them all; the process
    whose exit stopped the server, if one did."""
    processes = [engine, *servers]
    failed = None
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        ready = multiprocessing.connection.wait([p.sentinel for p in processes])
        ended = [p for p in processes if p.sentinel in ready]
        for process in ended:  # its sentinel closes a moment before its exit code is there
            process.join()
        failed = next((p for p in ended if p.exitcode != 0), ended[0])
        if failed is not engine and failed.exitcode != 0:
            # An engine that fails tells its API servers before it exits, so one of them can end
            # first; the engine's exit, when it follows, names the cause.
            engine.join(timeout=_SAY_WHY_SECONDS)
            if engine.exitcode not in (None, 0):
                failed = engine
        # An engine that failed ends its API servers, which say why: give them a moment to.
        multiprocessing.connection.wait([p.sentinel for p in servers], timeout=_SAY_WHY_SECONDS)
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        for server in servers:  # gracefully, then at once
            if server.is_alive():
                server.terminate()
        for server in servers:
            server.join(timeout=_GRACE_SECONDS)
            if server.is_alive():
                server.kill()
                server.join()
        engine.join(timeout=30)  # ends once its last pipe has closed
        if engine.is_alive():
            engine.kill()
            engine.join()
    return failed


def _raise_stop(*_: Any) -> None:
    raise _Stop


def _exit_quietly(*_: Any) -> None:
    raise SystemExit(0)


def _api_server_main(
    args: argparse.Namespace,
    config: ServerConfig,
    connection: EngineConnection,
    sock: socket.socket,
    table: Any,
) -> None:
    """API server process ``connection.front``: a front over the shared engine, the app, uvicorn on
    ``sock``, its own socket on the server's port; exits with an error when the engine cannot
    serve."""
    exit_with_parent()  # ``radixinfer serve`` killed: no server left accepting on its socket
    from radixinfer.async_llm import AsyncLLM
    from radixinfer.server.launch import serve_http
    from radixinfer.server.metrics import ServerMetrics

    # stopped by SIGTERM from ``radixinfer serve``: after uvicorn's graceful shutdown, which raises
    # the signal again, exit through `AsyncLLM.close` (this front's requests aborted) with code 0
    signal.signal(signal.SIGTERM, _exit_quietly)
    name_this_process(f"{API_SERVER_PROCESS_NAME}{connection.front}")
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    limits = {"max_waiting": args.max_waiting, "request_timeout": args.request_timeout}
    try:
        front = AsyncLLM(connection, **limits)
    except Exception as exc:  # noqa: BLE001 - the engine failed to start: its error, no traceback
        raise SystemExit(f"radixinfer serve: API server {connection.front}: {exc!r}") from exc
    with front, contextlib.closing(sock):
        serve_http(front, config, args, sock, ServerMetrics(table, connection.front))
