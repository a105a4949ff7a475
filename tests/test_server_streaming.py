"""What keeps streaming cheap under load: the latency histograms filled a request at a time expose
what ``prometheus_client``'s own would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from radixinfer.server.metrics import _LATENCY_BUCKETS, ServerMetrics


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
