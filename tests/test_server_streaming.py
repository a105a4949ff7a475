"""What keeps streaming cheap under load, and what it must not change: the latency histograms
filled a request at a time expose what ``prometheus_client``'s own would; a chunk written without
building a dict is the dict's JSON; a client that stops reading gets fewer, larger chunks and
loses nothing."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from radixinfer import LLM, SamplingParams
from radixinfer.server.answers import ChatChunks, Choice, CompletionChunks
from radixinfer.server.metrics import _LATENCY_BUCKETS, ServerMetrics
from radixinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.http_server import running_server


def _samples(text: bytes) -> dict[str, str]:
    """Exposition lines by name and labels, ``_created`` left out (a clock reading)."""
    lines = (line.rsplit(" ", 1) for line in text.decode().splitlines() if line[:1] != "#")
    return {name: value for name, value in lines if "_created" not in name}


def test_the_latency_histograms_expose_what_prometheus_histograms_would():
    arrival, steps = 10.0, [10.0005, 10.003, 10.003, 10.01, 10.5, 12.0, 100.0]
    metrics = ServerMetrics()
    metrics.record("length", 7, 9, steps, arrival)
    registry = CollectorRegistry()
    names = {
        "ttft": "radixinfer_time_to_first_token_seconds",
        "itl": "radixinfer_inter_token_latency_seconds",
        "e2e": "radixinfer_e2e_request_latency_seconds",
    }
    reference = {
        key: Histogram(name, key, buckets=_LATENCY_BUCKETS, registry=registry)
        for key, name in names.items()
    }
    reference["ttft"].observe(steps[0] - arrival)
    reference["e2e"].observe(steps[-1] - arrival)
    for a, b in zip(steps, steps[1:]):
        if b != a:  # a repeated step time (several completions of one step) is no gap
            reference["itl"].observe(b - a)
    ours = _samples(generate_latest(metrics.registry))
    theirs = _samples(generate_latest(registry))
    assert {k: v for k, v in ours.items() if k in theirs} == theirs
    assert ours["radixinfer_inter_token_latency_seconds_count"] == "5.0"
    assert ours["radixinfer_generation_tokens_total"] == "9.0"
    exposed = generate_latest(metrics.registry).decode()
    assert "# TYPE radixinfer_inter_token_latency_seconds histogram" in exposed
    assert "radixinfer_inter_token_latency_seconds_created " in exposed


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("with_ids", [False, True])
def test_a_chunk_without_logprobs_is_written_as_its_dict_would_encode(chat, with_ids):
    """The chunk written without building a dict has the same characters as the dict encoded."""
    if chat:
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], n=2)
        chunks = ChatChunks("m", body.model_copy(update={"return_token_ids": with_ids}))
    else:
        body = CompletionRequest(prompt="x", return_token_ids=with_ids)
        chunks = CompletionChunks("m", body)
    head = json.dumps({**chunks.head}, separators=(",", ":"))[:-1] + ',"choices":['
    texts = ["", "a", 'quote " and \\ and \n', "é中😀", "\ud800 lone", "\x00\x1f"]
    endings = [(None, None), ("length", None), ("stop", 7), ("stop", "END\n")]
    for index, text, (reason, stop) in itertools.product([0, 1], texts, endings):
        part = Choice(index, text, [3, 1, 4][: len(text) % 4], [], reason, stop)
        whole = Choice(index, "earlier " + text, [9, *part.token_ids])
        event = chunks.delta_event(part, whole)
        expected = json.dumps(chunks.delta_choice(part, whole), separators=(",", ":"))
        assert event == f"data: {head}{expected}]}}\n\n"
        assert json.loads(event[6:])["choices"][0]["index"] == index


def test_a_client_that_stops_reading_gets_coalesced_chunks_and_every_token_once():
    """A client that stops reading (its socket fills, then the server's write buffer, and the
    server's writes wait): the tokens made meanwhile reach it in fewer, larger chunks, every one
    once and in order; the text and the usage are generate's. Logprobs make each token's chunk
    ~1 KB, so a few hundred tokens fill the buffers."""
    params = SamplingParams(max_tokens=300, ignore_eos=True, logprobs=20)
    llm = LLM("tiny", block_size=4, num_blocks=1024)
    expected = llm.generate(["a slow reader"], params)[0]
    llm.reset_prefix_cache()
    body = {"prompt": "a slow reader", "max_tokens": 300, "ignore_eos": True, "stream": True}
    body.update(temperature=0, logprobs=20, return_token_ids=True)
    body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body).encode()
    with running_server(llm) as running:
        port = int(running.url.rsplit(":", 1)[1])
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
            sock.connect(("127.0.0.1", port))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            received = sock.recv(1024)
            deadline = time.monotonic() + 120
            while (stats := asyncio.run(running.engine.stats()))["running"] or stats["waiting"]:
                assert time.monotonic() < deadline  # not reading until the engine is done
                time.sleep(0.05)
            while data := sock.recv(65536):
                received += data
    body_bytes = _dechunked(received.partition(b"\r\n\r\n")[2])
    events = [e[6:] for e in body_bytes.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    assert [i for choice in choices for i in choice["token_ids"]] == expected.token_ids
    assert "".join(choice["text"] for choice in choices) == expected.text
    assert sum(len(choice["logprobs"]["tokens"]) for choice in choices) == 300
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    assert max(len(choice["token_ids"]) for choice in choices) > 1
    assert len(choices) < 300


def _dechunked(raw: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes."""
    parts, at = [], 0
    while (line_end := raw.find(b"\r\n", at)) >= 0:
        size = int(raw[at:line_end], 16)
        if size == 0:
            break
        parts.append(raw[line_end + 2 : line_end + 2 + size])
        at = line_end + 2 + size + 2
    return b"".join(parts)
