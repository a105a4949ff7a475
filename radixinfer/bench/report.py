"""Human-readable output: one column per variant, speedups of the first variant over the others, and a
compact one-line-per-run table over many ``--json`` files (``python -m radixinfer.bench.report F...``).

A speedup is > 1 when the first variant is better: ``other / first`` for latencies and wall time,
``first / other`` for throughputs. Beside the pooled speedups, each comparison pairs the measured rounds
(round r of every variant ran back to back, see `radixinfer.bench.runner`): the per-round output-throughput
ratios and their min / median / max show how far the pooled speedup stands above the noise.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STATS = ("mean", "p50", "p95", "p99")
THROUGHPUTS = ("output_throughput", "total_throughput", "request_throughput")
# (metric path, True when higher is better) for the speedup columns
SPEEDUP_KEYS: tuple[tuple[str, bool], ...] = (
    ("output_throughput", True),
    ("total_throughput", True),
    ("ttft_ms.p50", False),
    ("ttft_ms.p99", False),
    ("tpot_ms.p50", False),
    ("itl_ms.p50", False),
    ("e2e_ms.p50", False),
    ("e2e_ms.p99", False),
    ("wall_s", False),
)


def metric(metrics: dict, path: str) -> float | None:
    """``metric(m, "ttft_ms.p50")`` -> ``m["ttft_ms"]["p50"]``."""
    value = metrics
    for key in path.split("."):
        value = value[key]
    return value


def speedup(first: dict, other: dict, path: str, higher_is_better: bool) -> float | None:
    a, b = metric(first, path), metric(other, path)
    if not a or not b:
        return None
    return a / b if higher_is_better else b / a


def speedups(first: dict, other: dict) -> dict[str, float | None]:
    return {
        path: speedup(first, other, path, higher_is_better)
        for path, higher_is_better in SPEEDUP_KEYS
    }


def _rounds(run: dict) -> list[dict]:
    """A run's metrics per measured round: its ``repeats``, or with one round the pooled metrics (that round's)."""
    return run.get("repeats") or [run["metrics"]]


def paired_output_throughput(first: dict, other: dict) -> dict:
    """``first / other`` output throughput of each round (round r of both runs ran back to back, so process
    drift mostly cancels within a pair), and their min / median / max (None where a ratio is undefined)."""
    ratios = [
        speedup(a, b, "output_throughput", True) for a, b in zip(_rounds(first), _rounds(other))
    ]
    known = [r for r in ratios if r is not None]
    spread = (min(known), statistics.median(known), max(known)) if known else (None, None, None)
    return {"ratios": ratios, **dict(zip(("min", "median", "max"), spread))}


def comparisons(runs: list[dict]) -> list[dict]:
    """Speedups of the first run over each other run: pooled over all rounds, and output throughput per round."""
    return [
        {
            "baseline": runs[0]["label"],
            "other": run["label"],
            "speedup": speedups(runs[0]["metrics"], run["metrics"]),
            "paired_output_throughput": paired_output_throughput(runs[0], run),
        }
        for run in runs[1:]
    ]


def format_value(value: float | int | None, digits: int = 2) -> str:
    """A table cell: ``-`` for None, an int with thousands separators, a float to ``digits``."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def _rows(metrics: dict) -> list[tuple[str, str]]:
    rows = [
        (key, format_value(metrics[key]))
        for key in ("requests", "prompt_tokens", "cached_tokens", "computed_prompt_tokens")
    ]
    rows.append(("hit_rate", format_value(metrics["hit_rate"], 3)))
    rows += [(key, format_value(metrics[key])) for key in ("completion_tokens", "preemptions")]
    rows += [
        (f"{lat} {stat}", format_value(metrics[lat][stat])) for lat in LATENCIES for stat in STATS
    ]
    rows += [(f"{key} (/s)", format_value(metrics[key], 1)) for key in THROUGHPUTS]
    rows.append(("wall_s", format_value(metrics["wall_s"], 3)))
    # what the mean decode step read at the least, over the memory bandwidth (`decode_floor`)
    rows.append(("decode step reads MB", format_value(metrics["decode_read_mb"], 1)))
    rows.append(("decode step floor ms", format_value(metrics["decode_floor_ms"], 3)))
    rows.append(("floor / itl_ms p50", format_value(metrics["decode_floor_of_itl"], 3)))
    return rows


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """``rows`` of cells under ``header``, aligned in columns (the first to the left)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:  # first column left-aligned, numbers right-aligned
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


# (row label, memory_plan key, shown in GiB); a figure a plan lacks (None: not measured, a CPU)
# shows "-"
MEMORY_ROWS = (
    ("budget GiB", "budget_bytes", True),
    ("weights GiB", "weights_bytes", True),
    ("activations GiB", "activation_bytes", True),
    ("CUDA graphs GiB", "cuda_graph_bytes", True),
    ("other GiB", "other_bytes", True),
    ("host staging GiB", "host_staging_bytes", True),
    ("KV cache GiB", "kv_bytes", True),
    ("KV blocks", "num_blocks", False),
    ("KV tokens", "kv_tokens", False),
    ("max_model_len", "max_model_len", False),
)


def _memory_table(runs: list[dict]) -> str:
    """Each run's start-up memory plan (`radixinfer.engine.memory.MemoryPlan`), one column per run
    that has one; empty when none has (another backend)."""
    planned = [run for run in runs if run.get("info", {}).get("memory_plan")]
    if not planned:
        return ""

    def cell(plan: dict, key: str, in_gib: bool) -> str:
        value = plan.get(key)
        return format_value(value / 2**30 if in_gib and value is not None else value)

    rows = [
        [label, *(cell(run["info"]["memory_plan"], key, gib) for run in planned)]
        for label, key, gib in MEMORY_ROWS
    ]
    return text_table(["memory plan", *(run["label"] for run in planned)], rows)


def _round_spread(comparison: dict) -> str:
    """`` (min–max)`` of the per-round output-throughput ratios; empty with a single round (nothing to add)."""
    paired = comparison["paired_output_throughput"]
    return (
        f" ({format_value(paired['min'])}–{format_value(paired['max'])})"
        if len(paired["ratios"]) > 1
        else ""
    )


def format_report(result: dict) -> str:
    """Every metric, one column per run, then the speedups of the first run over the others (output
    throughput with the min–max of its per-round ratios beside it)."""
    runs, comps = result["runs"], result["comparisons"]
    columns = [dict(_rows(run["metrics"])) for run in runs]
    names = [name for name, _ in _rows(runs[0]["metrics"])]
    text = text_table(
        ["metric", *(r["label"] for r in runs)], [[n, *(c[n] for c in columns)] for n in names]
    )
    if comps:
        header = ["speedup of " + runs[0]["label"], *(c["other"] for c in comps)]
        rows = [
            [path, *(format_value(c["speedup"][path]) + "x" for c in comps)]
            for path, _ in SPEEDUP_KEYS
        ]
        spreads = [_round_spread(c) for c in comps]
        throughput = next(row for row in rows if row[0] == "output_throughput")
        throughput[1:] = [cell + spread for cell, spread in zip(throughput[1:], spreads)]
        text += "\n\n" + text_table(header, rows)
        if any(spreads):
            text += (
                "\n(in parentheses beside output_throughput: min–max of the paired rounds' ratios)"
            )
    if memory := _memory_table(runs):
        text += "\n\n" + memory
    return text


SUMMARY_COLUMNS = (
    ("hit", "hit_rate", 3),
    ("prompt tok", "prompt_tokens", 0),
    ("out tok/s", "output_throughput", 0),
    ("ttft p50", "ttft_ms.p50", 1),
    ("ttft p99", "ttft_ms.p99", 1),
    ("tpot p50", "tpot_ms.p50", 2),
    ("e2e p50", "e2e_ms.p50", 1),
    ("e2e p99", "e2e_ms.p99", 1),
    ("wall s", "wall_s", 2),
)


def summary_table(results: dict[str, dict]) -> str:
    """One line per run of each named result (latencies in ms), with the output-throughput speedup of
    the first run of that result over it."""
    rows = []
    for name, result in results.items():
        first = result["runs"][0]["metrics"]
        for run in result["runs"]:
            m = run["metrics"]
            cells = [format_value(metric(m, path), digits) for _, path, digits in SUMMARY_COLUMNS]
            speed = speedups(first, m)["output_throughput"]
            rows.append(
                [
                    f"{name}: {run['label']}",
                    *cells,
                    "" if run is result["runs"][0] else format_value(speed) + "x",
                ]
            )
    return text_table(["run", *(title for title, _, _ in SUMMARY_COLUMNS), "first vs this"], rows)


def main(paths: list[str]) -> int:
    print(summary_table({Path(p).stem: json.loads(Path(p).read_text()) for p in paths}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
