"""A real `radixinfer serve` app on a free loopback port, in a thread of the test process (uvicorn
on its own event loop), for the HTTP tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from radixinfer import LLM, AsyncLLM, EngineProcess
from radixinfer.data_parallel import DataParallelLLM
from radixinfer.server.app import ServerConfig, build_app

MODEL = "tiny"


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    engine: AsyncLLM | DataParallelLLM
    llm: LLM | EngineProcess | DataParallelLLM


@contextlib.contextmanager
def running_server(
    llm: LLM | EngineProcess | DataParallelLLM,
    *,
    max_waiting: int | None = None,
    request_timeout: float | None = None,
    add_routes: Callable[[FastAPI], None] | None = None,
    **config: object,
) -> Iterator[RunningServer]:
    """Serve ``llm`` (an engine thread, or an engine process, behind an `AsyncLLM` opened and closed
    here; or an open `DataParallelLLM`, which the caller closes) until the block ends; ``config``:
    `ServerConfig` fields beside the model name; ``add_routes`` may add a test's own routes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if isinstance(llm, DataParallelLLM):
        front = contextlib.nullcontext(llm)
    else:
        front = AsyncLLM(llm, max_waiting=max_waiting, request_timeout=request_timeout)
    with front as engine:
        app = build_app(engine, ServerConfig(model_name=MODEL, **config))
        if add_routes is not None:
            add_routes(app)
        server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        try:
            yield RunningServer(f"http://127.0.0.1:{port}", engine, llm)
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()
