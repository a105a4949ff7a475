"""Per-request timing records and the summary the benchmark reports.

Definitions (docs/api.md, The streaming benchmark), all from token timestamps taken where tokens leave the engine step:

- TTFT = first token - submit
- TPOT = (last token - first token) / (n - 1), for requests with n >= 2 tokens
- ITL  = every gap between consecutive arrivals of a request's tokens (pooled over requests): tokens
  that arrive together (one served chunk holding several, a step's samples of ``n`` > 1) are one
  arrival, so a server that coalesces its chunks shows the gap its client saw, not zeros (vLLM's
  and SGLang's benchmarks count ITL per chunk too); TPOT stays per token
- E2E  = last token - submit

Latencies are reported in milliseconds as mean / p50 / p95 / p99. Throughput divides tokens by the wall
time from the first submit to the last token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from radixinfer.outputs import StreamDelta

PERCENTILES = (50, 95, 99)


@dataclass
class RequestRecord:
    """What one request (one turn) did: when it was submitted and when each of its tokens arrived,
    and the prompt tokens its last delta says were read from the prefix cache (``cached_tokens``;
    None when the backend does not know)."""

    submit_time: float
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int | None = None

    def add(self, delta: StreamDelta) -> None:
        """Called on the consumer thread for every delta, which shares the GIL with the engine loop: a delta
        of one token (the usual case) costs no temporary list (0.63 -> 0.30 µs a delta on the dev CPU)."""
        ids = delta.token_ids
        self.token_ids += ids
        if len(ids) == 1:
            self.token_times.append(delta.timestamp)
        else:
            self.token_times += [delta.timestamp] * len(ids)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.cached_tokens = delta.num_cached_tokens

    def add_token(self, token: int, timestamp: float) -> None:
        """One token that does not finish the request (a `TokenBatch` row)."""
        self.token_ids.append(token)
        self.token_times.append(timestamp)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submit_time

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.submit_time

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        gaps = np.diff(self.token_times)
        return gaps[gaps > 0].tolist()  # tokens of one arrival share its time


def latency_ms(seconds: Iterable[float]) -> dict[str, float | None]:
    """mean and percentiles of ``seconds``, in milliseconds (None for an empty sample)."""
    values = np.asarray(list(seconds), dtype=np.float64) * 1e3
    if values.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {
        "mean": float(values.mean()),
        **{f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES},
    }


# The ``cache_stats()`` counters a run's metrics are taken from (their deltas over the run).
CACHE_COUNTERS = (
    "prompt_tokens",
    "cached_tokens",
    "computed_prompt_tokens",
    "cow_copies",
    "evicted_blocks",
    "preemptions",
    "host_hit_tokens",
    "loaded_tokens",
    "offloaded_tokens",
    "written_through_tokens",
    "loaded_bytes",
    "load_seconds",
    "decode_forwards",
    "decode_read_bytes",
)


def cache_delta(before: dict | None, after: dict | None) -> dict | None:
    """Counters accumulated between two ``cache_stats()`` snapshots (None when the backend has none)."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in CACHE_COUNTERS}


def add_cache_deltas(deltas: Sequence[dict | None]) -> dict | None:
    if not deltas or any(d is None for d in deltas):
        return None
    return {k: sum(d[k] for d in deltas) for k in deltas[0]}


def _reported_cache(records: Sequence[RequestRecord], prompt_tokens: int) -> dict | None:
    """`CACHE_COUNTERS` from the records' own ``cached_tokens`` (None unless every record has them):
    the prompt tokens, cached and computed; the engine's other counters (preemptions, the host
    tier's) are None."""
    if not records or any(r.cached_tokens is None for r in records):
        return None
    cached = sum(r.cached_tokens for r in records)
    counters = dict.fromkeys(CACHE_COUNTERS)
    counters.update(
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        computed_prompt_tokens=prompt_tokens - cached,
    )
    return counters


def summarize(
    records: Sequence[RequestRecord],
    wall_s: float,
    cache: dict | None,
    hbm_tbps: float | None = None,
) -> dict:
    """The reported metrics of one or more measured runs (records pooled, wall times summed).

    ``cache`` holds the engine's counter deltas over those runs. Without it (a server's counters are
    its own), cached and computed tokens and the hit rate come from the records' ``cached_tokens``
    when every record has them (a server that reports them in its usage), else they are None.
    ``clock_s``: the first submit and the last token, in ``time.perf_counter`` seconds (one clock for
    every process of a Linux machine: a run lines up with an engine's step trace by it). The mean decode
    step's floor at ``hbm_tbps`` comes from the counters (`decode_floor`).
    """
    prompt_tokens = sum(r.prompt_len for r in records)
    completion_tokens = sum(len(r.token_ids) for r in records)
    timed = [r for r in records if r.token_times]
    if cache is None:
        cache = _reported_cache(records, prompt_tokens)
    cached = cache["cached_tokens"] if cache else None
    itl_ms = latency_ms(gap for r in timed for gap in r.itls)
    return {
        "requests": len(records),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "computed_prompt_tokens": cache["computed_prompt_tokens"] if cache else None,
        "hit_rate": (cached / cache["prompt_tokens"] if cache["prompt_tokens"] else 0.0)
        if cache
        else None,
        "completion_tokens": completion_tokens,
        "preemptions": cache["preemptions"] if cache else None,
        "host_hit_tokens": cache["host_hit_tokens"] if cache else None,
        "loaded_tokens": cache["loaded_tokens"] if cache else None,
        "offloaded_tokens": cache["offloaded_tokens"] if cache else None,
        "written_through_tokens": cache["written_through_tokens"] if cache else None,
        # host-to-device bandwidth of the host tier's loads (their device time)
        "load_gb_per_s": cache["loaded_bytes"] / cache["load_seconds"] / 1e9
        if cache and cache["load_seconds"]
        else None,
        "ttft_ms": latency_ms(r.ttft for r in timed),
        "tpot_ms": latency_ms(t for t in (r.tpot for r in timed) if t is not None),
        "itl_ms": itl_ms,
        **decode_floor(cache, itl_ms["p50"], hbm_tbps),
        "e2e_ms": latency_ms(r.e2e for r in timed),
        "output_throughput": completion_tokens / wall_s if wall_s > 0 else None,
        "total_throughput": (prompt_tokens + completion_tokens) / wall_s if wall_s > 0 else None,
        "request_throughput": len(records) / wall_s if wall_s > 0 else None,
        "wall_s": wall_s,
        "clock_s": _clock(records),
    }


def decode_floor(
    cache: dict | None, itl_p50_ms: float | None, hbm_tbps: float | None
) -> dict[str, float | None]:
    """From a run's engine counter deltas (``cache``: None for a backend without them): the bytes the
    mean decode step read at the least (``decode_read_mb``, `radixinfer.engine.decode_bytes`), that over
    the memory bandwidth ``hbm_tbps`` (``decode_floor_ms``) and the floor's share of the inter-token
    latency's median (``decode_floor_of_itl``): how close decoding runs to what the memory allows, a
    regression visible at a glance. None where unknown."""
    # no counters, or None (a cache a server reported has no decode counters), or no decode step
    steps = cache["decode_forwards"] if cache else None
    if not steps:
        return dict.fromkeys(("decode_read_mb", "decode_floor_ms", "decode_floor_of_itl"))
    step_bytes = cache["decode_read_bytes"] / steps
    floor_ms = step_bytes / (hbm_tbps * 1e9) if hbm_tbps else None
    return {
        "decode_read_mb": step_bytes / 1e6,
        "decode_floor_ms": floor_ms,
        "decode_floor_of_itl": floor_ms / itl_p50_ms if floor_ms and itl_p50_ms else None,
    }


def _clock(records: Sequence[RequestRecord]) -> list[float] | None:
    """The first submit and the last token of ``records`` (None for none), as `summarize` says."""
    if not records:
        return None
    first = min(r.submit_time for r in records)
    return [first, max((r.token_times[-1] for r in records if r.token_times), default=first)]


def gc_pause_summary(pauses_ms: Sequence[float]) -> dict[str, float | int]:
    return {
        "count": len(pauses_ms),
        "total_ms": sum(pauses_ms),
        "max_ms": max(pauses_ms, default=0.0),
    }
