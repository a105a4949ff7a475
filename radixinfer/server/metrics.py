"""The server's Prometheus metrics (``GET /metrics``), each in its own registry so servers in one
process never share counters.

Counters and gauges:

- ``radixinfer_requests_total{finish_reason}``: finished requests by reason: stop, length,
  abort (the client went away, or the server closed), timeout, error
- ``radixinfer_prompt_tokens_total``, ``radixinfer_generation_tokens_total``: tokens of finished
  requests
- ``radixinfer_num_requests_running`` (requests holding KV), ``radixinfer_num_requests_waiting``
  (queued for admission): gauges
- ``radixinfer_prefix_cache_queried_tokens_total``: prompt tokens looked up in the prefix cache;
  ``radixinfer_prefix_cache_hit_tokens_total``: of those, found there (not computed)
- ``radixinfer_kv_blocks_used`` (held by requests or the prefix cache),
  ``radixinfer_kv_blocks_free``: gauges
- ``radixinfer_preemptions_total``: requests preempted under memory pressure
- ``radixinfer_decode_steps_total``, ``radixinfer_decode_read_bytes_total``: decode forwards run, and
  what they had to read from device memory at the least (`radixinfer.engine.decode_bytes`): their rate
  over the device's bandwidth is the share of the time decoding could not go below
- ``radixinfer_prefix_cache_gpu_hit_tokens_total`` / ``..._host_hit_tokens_total``: of the hit
  tokens, read where they were in the KV pool / loaded back from the host KV tier;
  ``radixinfer_host_cache_loaded_tokens_total`` / ``..._offloaded_tokens_total`` /
  ``..._written_through_tokens_total``: positions moved between the tiers (at a load, at an
  eviction, ahead of eviction); ``radixinfer_host_cache_loaded_bytes_total`` and
  ``radixinfer_host_cache_load_seconds_total`` (device time of the completed loads), and their
  ratio, ``radixinfer_host_cache_load_bandwidth_bytes_per_second`` (gauge);
  ``radixinfer_host_kv_blocks_free``: gauge (all 0 without a host tier)

With data-parallel replicas (``--data-parallel-size``), the families above add the replicas up,
and each replica has its own, labelled ``replica`` (0, 1, ...):
``radixinfer_replica_routed_requests_total`` (requests the router sent there),
``radixinfer_replica_num_requests_running`` / ``_waiting``,
``radixinfer_replica_prefix_cache_queried_tokens_total`` / ``_hit_tokens_total``,
``radixinfer_replica_prefix_cache_hit_rate`` (their ratio, a gauge), ``radixinfer_replica_kv_blocks_free``.

Histograms (seconds): ``radixinfer_time_to_first_token_seconds`` (first token - arrival),
``radixinfer_inter_token_latency_seconds`` (the gap between two engine steps that gave a request
tokens), ``radixinfer_e2e_request_latency_seconds`` (last token - arrival).

Token times are the engine step's (`StreamDelta.timestamp`), arrival the server's ``perf_counter``
when the request was queued. The histograms are filled a finished request at a time (`_Histogram`:
a bucket index per value, no lock): ``prometheus_client``'s ``Histogram.observe`` costs ~10 us a
value, and a request of 128 tokens has 127 gaps, which made recording the largest per-token cost of
the server's event loop. The engine's own counters (cache, blocks, preemptions, running /
waiting) are read from a snapshot taken between two steps at scrape time.

With several API server processes (``--api-server-count N``), the per-request numbers (requests,
tokens, histograms) live in a table in shared memory, a row per process that only it writes
(`shared_metrics_table`); every process exposes the rows' sum, and the engine's numbers come from
the one engine process, so a scrape that any process answers reports the whole server.
``radixinfer_api_server_requests_total{api_server}`` then counts each process's finished
requests.
"""

from __future__ import annotations

import multiprocessing
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector:
    """Turns the last engine snapshot into metric families when the registry is collected."""

    def __init__(self) -> None:
        self.snapshot: dict = {}

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if not s:
            return
        yield _gauge("radixinfer_num_requests_running", "requests holding KV", s["running"])
        yield _gauge(
            "radixinfer_num_requests_waiting", "requests queued for admission", s["waiting"]
        )
        yield _counter(
            "radixinfer_prefix_cache_queried_tokens",
            "prompt tokens looked up in the prefix cache",
            s["prompt_tokens"],
        )
        yield _counter(
            "radixinfer_prefix_cache_hit_tokens",
            "prompt tokens found in the prefix cache",
            s["cached_tokens"],
        )
        yield _gauge(
            "radixinfer_kv_blocks_used",
            "KV blocks held by requests or the prefix cache",
            s["total_blocks"] - s["free_blocks"],
        )
        yield _gauge("radixinfer_kv_blocks_free", "KV blocks free", s["free_blocks"])
        yield _counter(
            "radixinfer_preemptions", "requests preempted under memory pressure", s["preemptions"]
        )
        yield _counter("radixinfer_decode_steps", "decode forwards run", s["decode_forwards"])
        yield _counter(
            "radixinfer_decode_read_bytes",
            "bytes the decode forwards had to read from device memory at the least",
            s["decode_read_bytes"],
        )
        yield _counter(
            "radixinfer_prefix_cache_gpu_hit_tokens",
            "prompt tokens found in the prefix cache's KV pool",
            s["gpu_hit_tokens"],
        )
        yield _counter(
            "radixinfer_prefix_cache_host_hit_tokens",
            "prompt tokens found in the prefix cache's host tier (loaded back)",
            s["host_hit_tokens"],
        )
        yield _counter(
            "radixinfer_host_cache_loaded_bytes",
            "KV bytes loaded from the host tier",
            s["loaded_bytes"],
        )
        yield _counter(
            "radixinfer_host_cache_load_seconds",
            "device time of the loads from the host tier",
            s["load_seconds"],
        )
        yield _gauge(
            "radixinfer_host_cache_load_bandwidth_bytes_per_second",
            "loaded bytes over the loads' device time",
            s["load_gb_per_s"] * 1e9,
        )
        for what, how in (
            ("loaded", "loaded back from the host KV tier"),
            ("offloaded", "written back to the host KV tier at an eviction"),
            ("written_through", "copied to the host KV tier ahead of eviction"),
        ):
            yield _counter(
                f"radixinfer_host_cache_{what}_tokens", f"positions {how}", s[f"{what}_tokens"]
            )
        yield _gauge("radixinfer_host_kv_blocks_free", "host KV blocks free", s["host_free_blocks"])
        if "replicas" in s:
            yield from _replica_families(s["replicas"])


# per-replica families: (name, documentation, family type, value of one replica's snapshot)
_REPLICA_FAMILIES = (
    ("routed_requests", "requests the router sent to the replica", CounterMetricFamily, "routed"),
    ("num_requests_running", "requests holding KV", GaugeMetricFamily, "running"),
    ("num_requests_waiting", "requests queued for admission", GaugeMetricFamily, "waiting"),
    (
        "prefix_cache_queried_tokens",
        "prompt tokens looked up in the prefix cache",
        CounterMetricFamily,
        "prompt_tokens",
    ),
    (
        "prefix_cache_hit_tokens",
        "prompt tokens found in the prefix cache",
        CounterMetricFamily,
        "cached_tokens",
    ),
    ("prefix_cache_hit_rate", "hit tokens / queried tokens", GaugeMetricFamily, "hit_rate"),
    ("kv_blocks_free", "KV blocks free", GaugeMetricFamily, "free_blocks"),
)


def _replica_families(replicas: list[dict]) -> Iterator[Metric]:
    """One family per entry of `_REPLICA_FAMILIES`, a sample per replica (label ``replica``)."""
    for name, documentation, family_type, key in _REPLICA_FAMILIES:
        family = family_type(f"radixinfer_replica_{name}", documentation, labels=["replica"])
        for index, snapshot in enumerate(replicas):
            family.add_metric([str(index)], snapshot[key])
        yield family


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


# A row of the metrics table: one API server process's per-request numbers, which it alone writes.
# Requests by finish reason | prompt tokens | generated tokens | per histogram: its buckets' counts
# (the last above every bound), then its sum.
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
_REASON_SLOTS = {reason: slot for slot, reason in enumerate(FINISH_REASONS)}
_PROMPT_TOKENS = len(FINISH_REASONS)
_GENERATION_TOKENS = _PROMPT_TOKENS + 1
_NUM_BUCKETS = len(_LATENCY_BUCKETS) + 1
_HISTOGRAM_SLOTS = _NUM_BUCKETS + 1
ROW_WIDTH = _GENERATION_TOKENS + 1 + 3 * _HISTOGRAM_SLOTS


def shared_metrics_table(num_api_servers: int) -> Any:
    """A zeroed table of ``num_api_servers`` rows in shared memory (a ``multiprocessing`` array of
    doubles, which a spawned process receives as an argument): API server process ``i`` writes
    row ``i`` (`ServerMetrics`), and any of them reads the sum of the rows at scrape time."""
    return multiprocessing.get_context("spawn").RawArray("d", num_api_servers * ROW_WIDTH)


class _Counters:
    """The per-request counters, summed over the table's rows when the registry is collected; with
    several rows, also each API server process's finished requests (label ``api_server``)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def collect(self) -> Iterator[Metric]:
        totals = self.table.sum(axis=0)
        requests = CounterMetricFamily(
            "radixinfer_requests", "finished requests", labels=["finish_reason"]
        )
        for reason, slot in _REASON_SLOTS.items():
            requests.add_metric([reason], totals[slot])
        yield requests
        yield _counter(
            "radixinfer_prompt_tokens", "prompt tokens of finished requests", totals[_PROMPT_TOKENS]
        )
        yield _counter(
            "radixinfer_generation_tokens", "tokens generated", totals[_GENERATION_TOKENS]
        )
        if len(self.table) > 1:
            per_server = CounterMetricFamily(
                "radixinfer_api_server_requests",
                "finished requests served by each API server process",
                labels=["api_server"],
            )
            for index, row in enumerate(self.table):
                per_server.add_metric([str(index)], row[: len(FINISH_REASONS)].sum())
            yield per_server


class _Histogram:
    """A Prometheus histogram (``le`` buckets, ``_count``, ``_sum``, ``_created``) whose counts live
    in the metrics table from ``offset`` (`ROW_WIDTH`), observed by this process into its own row
    ``row`` and exposed summed over the rows, as ``prometheus_client``'s own histogram would be."""

    def __init__(
        self,
        name: str,
        documentation: str,
        registry: CollectorRegistry,
        table: np.ndarray,
        row: int,
        offset: int,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.table, self.row, self.offset = table, table[row], offset
        self.created = time.time()
        registry.register(self)

    def observe(self, values: Iterable[float]) -> None:
        """Add ``values`` to this process's row: counted in a list, added to the row once."""
        counts, bounds, total = [0] * _NUM_BUCKETS, _LATENCY_BUCKETS, 0.0
        for value in values:
            counts[bisect_left(bounds, value)] += 1  # the first bound >= value: its ``le`` bucket
            total += value
        start, row = self.offset, self.row
        row[start : start + _NUM_BUCKETS] += counts
        row[start + _NUM_BUCKETS] += total

    def collect(self) -> Iterator[Metric]:
        start = self.offset
        slots = self.table[:, start : start + _HISTOGRAM_SLOTS].sum(axis=0)
        buckets, total = [], 0
        for bound, count in zip([*map(float, _LATENCY_BUCKETS), "+Inf"], slots[:_NUM_BUCKETS]):
            total += int(count)
            buckets.append((str(bound), total))
        yield HistogramMetricFamily(
            self.name, self.documentation, buckets=buckets, sum_value=float(slots[_NUM_BUCKETS])
        )
        yield GaugeMetricFamily(f"{self.name}_created", self.documentation, value=self.created)


class ServerMetrics:
    """The server's metrics: per-request ones recorded as requests finish, the engine's at scrape
    time. ``table`` (`shared_metrics_table`, None: a private table of one row) holds the
    per-request numbers of every API server process of the server, this one writing row ``row``;
    they are exposed summed, so any process's ``/metrics`` reports the whole server."""

    def __init__(self, table: Any = None, row: int = 0) -> None:
        if table is None:
            table = np.zeros(ROW_WIDTH)
        self._table = np.frombuffer(table, dtype=np.float64).reshape(-1, ROW_WIDTH)
        if not 0 <= row < len(self._table):
            raise ValueError(f"row: {row} is not a row of a table of {len(self._table)}")
        self._row = self._table[row]
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self.registry.register(_Counters(self._table))
        self.ttft, self.itl, self.e2e = (
            _Histogram(name, documentation, self.registry, self._table, row, offset)
            for (name, documentation), offset in zip(
                (
                    ("radixinfer_time_to_first_token_seconds", "first token - arrival"),
                    ("radixinfer_inter_token_latency_seconds", "gap between token steps"),
                    ("radixinfer_e2e_request_latency_seconds", "last token - arrival"),
                ),
                range(_GENERATION_TOKENS + 1, ROW_WIDTH, _HISTOGRAM_SLOTS),
            )
        )

    def record(
        self,
        finish_reason: str,
        prompt_tokens: int,
        generated_tokens: int,
        step_times: list[float],
        arrival: float,
    ) -> None:
        """One finished request: its reason (one of `FINISH_REASONS`), prompt length, tokens
        generated, and the engine-step times that gave it tokens, in order
        (`AsyncStream.step_times`)."""
        row = self._row
        row[_REASON_SLOTS[finish_reason]] += 1
        row[_PROMPT_TOKENS] += prompt_tokens
        row[_GENERATION_TOKENS] += generated_tokens
        if not step_times:
            return
        self.ttft.observe((step_times[0] - arrival,))
        self.e2e.observe((step_times[-1] - arrival,))
        self.itl.observe(b - a for a, b in zip(step_times, step_times[1:]) if b != a)

    def render(self, engine_snapshot: dict) -> bytes:
        """The Prometheus text exposition, with the engine's numbers from ``engine_snapshot``
        (``cache_stats()`` plus ``running`` and ``waiting``; with replicas, their sum and each
        one's under ``"replicas"``, `DataParallelLLM.stats`)."""
        self._engine.snapshot = engine_snapshot
        return generate_latest(self.registry)
