"""The flags of ``radixinfer serve`` and what it runs: an engine process and the `AsyncLLM` over it
(or, with ``--data-parallel-size M``, M replicas behind a `DataParallelLLM`), uvicorn; with
``--api-server-count N`` > 1, N API server processes over one engine process
(`radixinfer.server.api_servers`).

Imports FastAPI and uvicorn only when serving, so the other subcommands run without them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import socket
from typing import TYPE_CHECKING

from radixinfer.engine_args import add_engine_arguments, check_engine_arguments, llm_kwargs

if TYPE_CHECKING:
    from radixinfer.async_llm import AsyncLLM
    from radixinfer.data_parallel import DataParallelLLM
    from radixinfer.server.app import ServerConfig
    from radixinfer.server.metrics import ServerMetrics


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    http = parser.add_argument_group("HTTP")
    http.add_argument(
        "--host", default="127.0.0.1", help="address to listen on [127.0.0.1: loopback]"
    )
    http.add_argument("--port", type=int, default=8000, help="[8000]")
    http.add_argument(
        "--served-model-name", default=None, help="the model's name in the API [--model]"
    )
    http.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and /reset_prefix_cache",
    )
    http.add_argument(
        "--cache-salt-header",
        default=None,
        metavar="NAME",
        help="take each request's cache salt (its tenant) from this header, set by a "
        "gateway; the body's cache_salt is then ignored",
    )
    http.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests queued for admission; more get 429 [1024]",
    )
    http.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may run before it is aborted [none]",
    )
    http.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 2**20,
        help="larger request bodies get 413 [4 MiB]",
    )
    http.add_argument("--log-level", default="warning", help="uvicorn's log level [warning]")
    http.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="HTTP server processes over the one engine process, each accepting on its own socket of "
        "the port (SO_REUSEPORT: the kernel spreads connections evenly over them): "
        "more than one when one process's event loop cannot stream the engine's tokens as fast as "
        "it makes them (not with --data-parallel-size > 1) [1]",
    )
    http.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="the fewest tokens a streamed chunk holds (the last may hold fewer); a stream whose "
        "client is behind gets everything waiting for it in one chunk anyway [1]",
    )
    http.add_argument(
        "--gc-threshold",
        type=int,
        default=50_000,
        metavar="N",
        help="the garbage collector's young-generation threshold, in the HTTP process and the "
        "engine process (streaming allocates a delta per token; Python's default of 700 collects "
        "every step of a wide batch; 0 leaves it) [50000]",
    )

    add_engine_arguments(parser)
    add_data_parallel_arguments(parser)


def add_data_parallel_arguments(parser: argparse.ArgumentParser, default_size: int = 1) -> None:
    """The ``data parallelism`` flag group (``radixinfer serve``, ``bench_data_parallel.py``),
    ``--data-parallel-size`` defaulting to ``default_size``."""
    from radixinfer.data_parallel import DEFAULT_LOAD_MARGIN
    from radixinfer.router import POLICIES

    group = parser.add_argument_group("data parallelism (docs/multi-gpu.md)")
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=default_size,
        metavar="M",
        help="engine replicas behind one endpoint, each a process with its own model copy and KV "
        "cache; on CUDA replica r uses GPUs r*TP .. r*TP+TP-1 (TP: --tensor-parallel-size) "
        f"[{default_size}]",
    )
    group.add_argument(
        "--router-policy",
        choices=POLICIES,
        default="cache_aware",
        help="where each request goes: the replica caching the longest prefix of it, replicas in "
        "turn, or the replica with the fewest requests in flight [cache_aware]",
    )
    group.add_argument(
        "--router-load-margin",
        type=int,
        default=DEFAULT_LOAD_MARGIN,
        metavar="N",
        help="cache_aware skips a replica with more than N requests in flight beyond the least "
        f"loaded one [{DEFAULT_LOAD_MARGIN}]",
    )


def check_data_parallel_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
    """``--data-parallel-size`` and the router's flags, and that the GPUs are there."""
    from radixinfer.distributed.torchrun import torchrun_rank

    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be >= 1")
    if args.router_load_margin < 0:
        parser.error("--router-load-margin must be >= 0")
    if args.data_parallel_size > 1 and torchrun_rank() is not None:
        parser.error("--data-parallel-size > 1 starts its replicas itself: not under torchrun")
    if args.data_parallel_size > 1:
        from radixinfer.data_parallel import replica_processes

        try:
            replica_processes(llm_kwargs(args), args.data_parallel_size)
        except ValueError as exc:  # the message starts with the argument's name
            parser.error(f"--{exc}".replace("data_parallel_size", "data-parallel-size", 1))


def check_serve_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag checks argparse cannot express; errors exit through ``parser.error``."""
    if not 0 <= args.port < 65536:
        parser.error("--port must be in [0, 65535]")
    if min(args.max_waiting, args.max_body_bytes, args.stream_interval) < 1:
        parser.error("--max-waiting, --max-body-bytes and --stream-interval must be >= 1")
    if args.request_timeout is not None and not args.request_timeout > 0:
        parser.error("--request-timeout must be > 0")
    if args.gc_threshold < 0:
        parser.error("--gc-threshold must be >= 0")
    if args.api_key is not None and not args.api_key:
        parser.error("--api-key must not be empty")
    if args.api_server_count < 1:
        parser.error("--api-server-count must be >= 1")
    check_engine_arguments(parser, args)
    check_data_parallel_arguments(parser, args)
    if args.api_server_count > 1 and args.data_parallel_size > 1:
        parser.error(
            "--api-server-count > 1 serves one engine process; with --data-parallel-size > 1 "
            "the replicas are behind one API server: use one or the other"
        )


def serve(args: argparse.Namespace) -> None:
    """Start the engine process (or the data-parallel replicas) and serve HTTP until interrupted;
    stopping stops the engine. With ``--api-server-count N`` > 1, N API server processes serve
    over one engine process (`radixinfer.server.api_servers`)."""
    from radixinfer.async_llm import AsyncLLM
    from radixinfer.data_parallel import DataParallelLLM, replica_processes
    from radixinfer.engine_process import EngineProcess
    from radixinfer.server.app import ServerConfig

    config = ServerConfig(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key,
        cache_salt_header=args.cache_salt_header,
        max_body_bytes=args.max_body_bytes,
        stream_interval=args.stream_interval,
    )
    if args.gc_threshold:  # before the engine process starts: it copies the thresholds
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    sockets = bind_sockets(args.host, args.port, args.api_server_count)
    if args.api_server_count > 1:
        from radixinfer.server.api_servers import run_api_servers

        with contextlib.ExitStack() as stack:
            for sock in sockets:
                stack.enter_context(sock)
            run_api_servers(args, config, sockets)
        return
    (sock,) = sockets
    limits = {"max_waiting": args.max_waiting, "request_timeout": args.request_timeout}
    if args.data_parallel_size == 1:
        front: AsyncLLM | DataParallelLLM = AsyncLLM(EngineProcess(**llm_kwargs(args)), **limits)
    else:
        try:
            front = DataParallelLLM(
                replica_processes(llm_kwargs(args), args.data_parallel_size),
                policy=args.router_policy,
                load_margin=args.router_load_margin,
                **limits,
            )
        except RuntimeError as exc:  # a replica that failed to start: its error, no traceback
            raise SystemExit(f"radixinfer serve: {exc}") from exc
    with front as llm, sock:
        serve_http(llm, config, args, sock)


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` TCP sockets bound to ``host``:``port`` (IPv6 when ``host`` has a colon; port 0: a
    free port, the same for all), not yet listening: the server listens once its app is up, so a
    client connecting earlier is refused, not kept waiting. Raises ``SystemExit`` when the address
    is taken or cannot be bound.

    With ``count`` > 1, one socket per API server process, each with ``SO_REUSEPORT``: the kernel
    hashes each connection to one of the listening sockets, so the processes share a burst evenly.
    On one shared socket, whichever process is free when the burst arrives takes it (asyncio accepts
    up to its backlog of connections per wake-up), and streams then pile onto one event loop."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # port 0 picked a free one: the others share it
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise SystemExit(f"radixinfer serve: cannot listen on {host}:{port}: {exc}") from exc
    return sockets


def serve_http(
    llm: AsyncLLM | DataParallelLLM,
    config: ServerConfig,
    args: argparse.Namespace,
    sock: socket.socket,
    metrics: ServerMetrics | None = None,
) -> None:
    """Serve the app over ``llm`` (open) on ``sock`` with uvicorn until interrupted (SIGINT or
    SIGTERM: open streams get 5 s, then are cut and their requests aborted); ``metrics``: the
    API server's (`build_app`'s default: its own)."""
    import uvicorn

    from radixinfer.server.app import build_app

    app = build_app(llm, config, metrics)
    # What is alive now (torch, the app) lives as long as the server: out of the collector's full
    # passes, which would rescan it while streams wait.
    gc.collect()
    gc.freeze()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,  # then open streams are cut and their requests aborted
        )
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it stopped on
        server.run(sockets=[sock])
