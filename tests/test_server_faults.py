"""``radixinfer serve`` under faults, bounded in count and time, loopback only: 200 concurrent
streams, 50 clients that leave mid-stream, a flood beyond the waiting queue, and a table of
malformed bodies."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from radixinfer import LLM, SamplingParams
from tests.http_server import leave_mid_stream, running_server, stream_texts

PROMPTS = [f"client {i} asks" for i in range(10)]


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny", block_size=4, num_blocks=2048, max_batch_size=256)
    with running_server(llm) as running:
        yield running


def wait_idle(server, timeout: float = 30) -> dict:
    """The engine's stats once no request runs or waits."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.engine.call(_stats).result()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


def _stats(llm: LLM) -> dict:
    engine = llm.engine
    return {**llm.cache_stats(), "running": len(engine.active), "waiting": len(engine.waiting)}


def test_200_concurrent_streams_all_complete_with_the_right_text(server):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = server.engine.call(
        lambda llm: llm.generate(PROMPTS, params)
    ).result()  # the idle engine
    expected = {p: o.text for p, o in zip(PROMPTS, outputs)}

    texts = stream_texts(server.url, [PROMPTS[i % 10] for i in range(200)], 8)
    assert texts == [expected[PROMPTS[i % 10]] for i in range(200)]


def test_50_clients_leaving_mid_stream_abort_and_free_every_block(server):
    before = server.engine.call(_stats).result()

    leave_mid_stream(server.url, 50)
    after = wait_idle(server)
    # aborted, not run to 1,500 tokens
    assert after["decode_forwards"] - before["decode_forwards"] < 1000
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    stats = server.engine.call(_stats).result()
    assert stats["free_blocks"] == stats["total_blocks"]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'radixinfer_requests_total{finish_reason="abort"} 50.0' in metrics


def test_a_flood_beyond_the_queue_gets_429_and_the_server_keeps_answering():
    llm = LLM("tiny", block_size=4, num_blocks=512, max_num_seqs=1)
    with running_server(llm, max_waiting=2) as running:
        url = f"{running.url}/v1/completions"

        async def main() -> list[int]:
            async with httpx.AsyncClient(
                limits=httpx.Limits(max_connections=None), timeout=60
            ) as client:
                body = {"prompt": "hog", "max_tokens": 1500, "ignore_eos": True, "stream": True}
                async with client.stream("POST", url, json=body) as hog:
                    lines = hog.aiter_lines()
                    await lines.__anext__()  # the hog holds the only seat
                    flood = [
                        client.post(url, json={"prompt": f"flood {i}", "max_tokens": 2})
                        for i in range(20)
                    ]
                    tasks = [asyncio.ensure_future(request) for request in flood]
                    deadline = time.monotonic() + 30
                    while sum(task.done() for task in tasks) < 18:  # all but the queue's two
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.01)
                # the hog has left: the two queued ones run
                return [response.status_code for response in await asyncio.gather(*tasks)]

        statuses = asyncio.run(main())
        assert sorted(statuses) == [200] * 2 + [429] * 18
        answer = httpx.post(url, json={"prompt": "still here", "max_tokens": 2})
        assert (
            answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
        )


def test_requests_past_their_timeout_get_504_or_an_error_event_and_free_their_blocks():
    llm = LLM("tiny", block_size=4, num_blocks=1024)
    with running_server(llm, request_timeout=1.0) as running:
        url = f"{running.url}/v1/completions"
        body = {"prompt": "slow", "max_tokens": 2000, "ignore_eos": True}
        whole = httpx.post(url, json=body, timeout=60)
        assert whole.status_code == 504 and "timeout" in whole.json()["error"]["message"]
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as streamed:
            lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert wait_idle(running)["decode_forwards"] < 1500  # aborted, not run to 2,000 tokens
        assert httpx.post(f"{running.url}/reset_prefix_cache").status_code == 200
        metrics = httpx.get(f"{running.url}/metrics").text
        assert 'radixinfer_requests_total{finish_reason="timeout"} 2.0' in metrics


def test_a_chunked_body_over_the_limit_gets_413(server):
    def ten_megabytes():
        for _ in range(10):
            yield b"x" * 2**20

    answer = httpx.post(f"{server.url}/v1/completions", content=ten_megabytes(), timeout=60)
    assert answer.status_code == 413 and answer.json()["error"]["message"]


HUGE_INT = b"9" * 5000
BODIES = {
    "empty": b"",
    "not json": b"prompt=hello",
    "invalid utf-8": b"\xff\xfe\xfd{",
    "invalid utf-8 in a string": b'{"prompt": "\xff\xfe"}',
    "a list": b"[]",
    "null": b"null",
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "missing prompt": b'{"max_tokens": 4}',
    "prompt a number": b'{"prompt": 5}',
    "prompt null": b'{"prompt": null}',
    "empty prompt": b'{"prompt": ""}',
    "empty id list": b'{"prompt": []}',
    "negative id": b'{"prompt": [1, -1]}',
    "id past the vocabulary": b'{"prompt": [1, 100000]}',
    "id past int64": b'{"prompt": [1, 100000000000000000000000000000]}',
    "two prompts": b'{"prompt": ["a", "b"]}',
    "prompt past the context": json.dumps({"prompt": "x" * 5000}).encode(),
    "max_tokens a string": b'{"prompt": "x", "max_tokens": "5"}',
    "max_tokens a float": b'{"prompt": "x", "max_tokens": 5.5}',
    "max_tokens zero": b'{"prompt": "x", "max_tokens": 0}',
    "max_tokens negative": b'{"prompt": "x", "max_tokens": -3}',
    "max_tokens past int64": b'{"prompt": "x", "max_tokens": 100000000000000000000000000}',
    "max_tokens 5,000 digits": b'{"prompt": "x", "max_tokens": ' + HUGE_INT + b"}",
    "temperature infinite": b'{"prompt": "x", "temperature": 1e999}',
    "temperature NaN": b'{"prompt": "x", "temperature": NaN}',
    "temperature negative": b'{"prompt": "x", "temperature": -1}',
    "temperature a bool": b'{"prompt": "x", "temperature": true}',
    "top_p zero": b'{"prompt": "x", "top_p": 0}',
    "top_k below -1": b'{"prompt": "x", "top_k": -5}',
    "seed a string": b'{"prompt": "x", "seed": "abc"}',
    "stream a string": b'{"prompt": "x", "stream": "yes"}',
    "stream_options a number": b'{"prompt": "x", "stream": true, "stream_options": 5}',
    "stop_token_ids negative": b'{"prompt": "x", "stop_token_ids": [-1]}',
    "stop_token_ids past int64": b'{"prompt": "x", "stop_token_ids": [100000000000000000000000]}',
    "cache_salt a number": b'{"prompt": "x", "cache_salt": 5}',
    "n zero": b'{"prompt": "x", "n": 0}',
    "n past the limit": b'{"prompt": "x", "n": 5000}',
    "stop a number": b'{"prompt": "x", "stop": 5}',
    "stop an empty string": b'{"prompt": "x", "stop": [""]}',
    "logprobs negative": b'{"prompt": "x", "logprobs": -1}',
    "logprobs past the vocabulary": b'{"prompt": "x", "logprobs": 100000}',
    "10 MB": json.dumps({"prompt": "x" * (10 * 2**20)}).encode(),
}
CHAT_BODIES = {
    "no messages": b'{"messages": []}',
    "messages a string": b'{"messages": "hi"}',
    "unknown role": b'{"messages": [{"role": "robot", "content": "x"}]}',
    "an image part": b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    "content a number": b'{"messages": [{"role": "user", "content": 5}]}',
    "max_completion_tokens zero": b'{"messages": [{"role": "user", "content": "x"}], '
    b'"max_completion_tokens": 0}',
    "top_logprobs without logprobs": b'{"messages": [{"role": "user", "content": "x"}], '
    b'"top_logprobs": 2}',
    "logprobs a number": b'{"messages": [{"role": "user", "content": "x"}], "logprobs": 2}',
}


@pytest.mark.parametrize(
    "route, body",
    [("/v1/completions", b) for b in BODIES.values()]
    + [("/v1/chat/completions", b) for b in CHAT_BODIES.values()],
    ids=list(BODIES) + [f"chat: {name}" for name in CHAT_BODIES],
)
def test_malformed_bodies_get_a_4xx_with_a_message_never_a_500(server, route, body):
    answer = httpx.post(
        f"{server.url}{route}",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert answer.status_code in (400, 413, 422), answer.text
    assert answer.json()["error"]["message"]


def test_the_server_still_answers_after_the_malformed_bodies(server):
    answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "fine", "max_tokens": 2})
    assert answer.status_code == 200
    assert wait_idle(server)["running"] == 0
