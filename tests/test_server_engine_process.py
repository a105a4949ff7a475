"""``radixinfer serve`` with the engine in a process of its own, as the command runs it: a stream
whose consumer falls behind gets every waiting token in one chunk, exactly once and in order;
clients that leave abort their requests and free every block; an engine process that dies fails
open streams and later requests instead of leaving them waiting."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from fastapi import FastAPI

from radixinfer import LLM, EngineProcess, SamplingParams
from tests.http_server import leave_mid_stream, running_server

ENGINE = {"model": "tiny", "block_size": 4, "num_blocks": 1024, "max_batch_size": 64}


def add_stall_route(app: FastAPI) -> None:
    @app.post("/test/stall")
    async def stall(seconds: float) -> dict:
        time.sleep(seconds)  # blocks the server's event loop: every stream falls behind
        return {}


@pytest.fixture(scope="module")
def server():
    with running_server(EngineProcess(**ENGINE), add_routes=add_stall_route) as running:
        yield running


def wait_idle(server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while (stats := asyncio.run(server.engine.stats()))["running"] or stats["waiting"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    return stats


def data_lines(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def test_a_stream_that_falls_behind_gets_every_waiting_token_in_one_chunk_in_order(server):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    expected = LLM(**ENGINE).generate(["coalesce me"], params)[0]
    body = {
        "prompt": "coalesce me",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = data_lines(response)
        chunks = [json.loads(next(lines))]
        assert httpx.post(f"{server.url}/test/stall", params={"seconds": 0.5}).status_code == 200
        chunks += [json.loads(line) for line in lines if line != "[DONE]"]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    ids = [i for choice in choices for i in choice["token_ids"]]
    assert ids == expected.token_ids  # every token once, in order
    assert "".join(choice["text"] for choice in choices) == expected.text
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    # the tokens made while the event loop stood still went out together
    assert max(len(choice["token_ids"]) for choice in choices) > 1
    assert len(choices) < 200


def test_clients_leaving_mid_stream_abort_and_free_every_block(server):
    before = wait_idle(server)

    leave_mid_stream(server.url, 20)
    after = wait_idle(server)
    # aborted, not run to 1,500 tokens
    assert after["decode_forwards"] - before["decode_forwards"] < 1000
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    stats = asyncio.run(server.engine.stats())
    assert stats["free_blocks"] == stats["total_blocks"]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'radixinfer_requests_total{finish_reason="abort"} 20.0' in metrics


def test_an_engine_process_that_dies_fails_open_streams_and_later_requests():
    with running_server(EngineProcess(**ENGINE)) as running:
        url = f"{running.url}/v1/completions"
        body = {"prompt": "doomed", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            lines = data_lines(response)
            next(lines)  # streaming
            os.kill(running.engine.engine_pid, signal.SIGKILL)
            rest = list(lines)  # ends: no hang
        assert '"error"' in rest[-2] and rest[-1] == "[DONE]"
        answer = httpx.post(url, json={"prompt": "anyone?", "max_tokens": 2}, timeout=30)
        assert answer.status_code == 503 and "engine" in answer.json()["error"]["message"]
        assert httpx.get(f"{running.url}/health", timeout=30).status_code == 503
