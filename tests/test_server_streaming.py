"""What keeps streaming cheap under load, and what it must not change: the latency histograms
filled a request at a time expose what ``prometheus_client``'s own would; a chunk written without
building a dict is the dict's JSON."""

from __future__ import annotations

import itertools
import json

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from radixinfer.server.answers import ChatChunks, Choice, CompletionChunks
from radixinfer.server.metrics import _LATENCY_BUCKETS, ServerMetrics
from radixinfer.server.protocol import ChatCompletionRequest, CompletionRequest


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
