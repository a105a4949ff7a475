"""A real `radixinfer serve` app on a free loopback port, for the HTTP tests: in a thread of the
test process (uvicorn on its own event loop, `running_server`), or the command itself as a
subprocess (`serve_process`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from radixinfer import LLM, AsyncLLM, EngineProcess
from radixinfer.data_parallel import DataParallelLLM
from radixinfer.engine_process import named_children
from radixinfer.server.app import ServerConfig, build_app

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[1]


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


def stream_texts(
    url: str, prompts: list[str], max_tokens: int, headers: dict[str, str] | None = None
) -> list[str]:
    """The greedy texts of ``prompts`` (``max_tokens`` each, EOS ignored), streamed from server
    ``url`` all at once, one connection each."""

    async def stream_text(client: httpx.AsyncClient, prompt: str) -> str:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += [choice["text"] for choice in json.loads(line[6:])["choices"]]
        return "".join(text)

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(stream_text(client, prompt) for prompt in prompts))

    return asyncio.run(main())


def leave_mid_stream(url: str, count: int, headers: dict[str, str] | None = None) -> None:
    """``count`` clients at once each start a stream of 1,500 tokens at server ``url`` and leave
    (close the connection) after its second chunk."""

    async def leave_after_two_chunks(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"leaving {i}", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks == 2:
                    return  # leaving the block closes the connection mid-stream

    async def main() -> None:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=60) as client:
            await asyncio.gather(*(leave_after_two_chunks(client, i) for i in range(count)))

    asyncio.run(main())


@dataclass
class ServeProcess:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen

    def children(self) -> dict[str, int]:
        """The command's child processes by name (``radixinfer-core``: the engine process;
        ``radixinfer-api0``, ...: the API server processes)."""
        return named_children(self.process.pid)


@contextlib.contextmanager
def serve_process(*flags: str, timeout: float = 180) -> Iterator[ServeProcess]:
    """``radixinfer serve FLAGS`` (model ``tiny`` unless the flags say) as a subprocess on a free
    loopback port, answering ``/health`` before the block runs (within ``timeout`` seconds); sent
    SIGINT after it, then killed if it has not exited within 30 s."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "radixinfer.cli", "serve", "--port", str(port), *flags]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield ServeProcess(url, process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
