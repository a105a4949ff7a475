"""``benchmarks/bench_serve.py`` on the CPU: its flag split, and one bounded served-against-in-process
run of the stub model through a real server on loopback."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench_serve():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_engine_flags_go_to_the_server_with_their_values(bench_serve):
    argv = ["--model", "tiny", "--dataset", "shared-prefix", "--max-batch-size=512"]
    argv += ["--no-prefix-cache", "--num-groups", "2", "--dtype", "float32"]
    engine, rest = bench_serve._split_flags(argv)
    assert engine == ["--model", "tiny", "--max-batch-size=512", "--no-prefix-cache"] + [
        "--dtype",
        "float32",
    ]
    assert rest == ["--dataset", "shared-prefix", "--num-groups", "2"]


def test_a_step_trace_splits_into_bursts_and_sums_each_up(bench_serve, tmp_path):
    """Two bursts (each after a wait for work): requests, when they stopped arriving, the span,
    the prefill's end, the steady decode pass, and the steps in which requests finished."""
    from radixinfer.engine_core import StepTrace

    # take, start, end, idle, added, waiting, active, computed, events, cpu, gc, preempted;
    # times in seconds
    rows = [
        (0.000, 0.010, 0.020, 1, 3, 1, 3, 96, 0, 0.009, 0.0, 0),  # a burst: 3 requests, a prefill
        (0.020, 0.021, 0.030, 0, 1, 0, 4, 32, 3, 0.008, 0.001, 1),  # one more, the last prefill
        (0.030, 0.031, 0.033, 0, 0, 0, 4, 0, 1, 0.001, 0.0, 0),  # steady decode
        (0.033, 0.034, 0.036, 0, 0, 0, 4, 0, 1, 0.001, 0.0, 0),
        (0.036, 0.037, 0.040, 0, 0, 0, 2, 0, 3, 0.002, 0.0, 2),  # two finish
        (0.040, 0.041, 0.043, 0, 0, 0, 0, 0, 2, 0.001, 0.002, 0),  # the last two finish
        (1.000, 1.500, 1.510, 1, 2, 0, 2, 10, 0, 0.005, 0.0, 0),  # the next burst
        (1.510, 1.511, 1.520, 0, 0, 0, 0, 0, 2, 0.002, 0.0, 0),
    ]
    path = tmp_path / "engine-thread-1-0.steps"
    lines = [" ".join(StepTrace.FIELDS)] + [" ".join(map(str, row)) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    first, second = bench_serve.trace_bursts(path)
    assert (len(first), len(second)) == (6, 2)
    summary = bench_serve.burst_summary(first)
    assert summary["requests"] == 4 and summary["ending steps"] == 2
    expected = {"arrivals ms": 11, "span ms": 33, "prefill ms": 20, "ending ms": 5}
    expected |= {"ending cpu ms": 3, "gc ms": 3, "preempted": 3}
    assert {k: round(summary[k], 6) for k in expected} == expected
    assert summary["decode pass ms"] == pytest.approx(3.0)  # 0.031 -> 0.034 -> 0.037
    assert bench_serve.burst_summary(second)["requests"] == 2


@pytest.mark.parametrize("processes", [1, 2])
def test_a_stub_run_prints_both_tables_the_ratio_and_the_server_cpu(tmp_path, processes):
    """One process of each kind, or two API server processes read by two client processes: the
    same requests and tokens either way, and the CPU of every process counted."""
    out = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), "--stub-model", "--num-requests", "8"]
    command += ["--max-new-tokens", "4", "--no-stop-on-eos", "--json", str(out)]
    command += ["--api-server-count", str(processes), "--client-processes", str(processes)]
    command += ["--step-trace", str(tmp_path / "steps")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "openai cache=on" in done.stdout and "radixinfer cache=on" in done.stdout
    assert "speedup of" in done.stdout and "front" in done.stdout
    assert f"API server processes: {processes}, client processes: {processes}" in done.stdout
    result = json.loads(out.read_text())
    first, served = result["runs"]
    assert first["backend"] == "radixinfer" and served["backend"] == "openai"
    assert first["metrics"]["completion_tokens"] == served["metrics"]["completion_tokens"] == 32
    assert result["comparisons"][0]["speedup"]["output_throughput"] > 0
    cpu = result["served_cpu"]
    assert cpu["requests"] == 8 and cpu["tokens"] == 32
    assert cpu["seconds"]["front"] > 0 and cpu["seconds"]["engine"] > 0
    assert cpu["seconds"]["client"] > 0
    assert result["served_processes"] == {"api_servers": processes, "client_processes": processes}
    assert "engine steps by burst" in done.stdout
    taken = {"served": 0, "in-process": 0}
    for row in result["step_trace"]:  # a burst is a run where the work outlasts the arrivals
        taken[row["half"]] += row["requests"]
    assert taken == {"served": 8, "in-process": 8}  # no warm-up: the in-process engine is a CPU's
    # the measured run's first burst in each half: its requests came after the run's first submit
    for half in ("served", "in-process"):
        first = next(row for row in result["step_trace"] if row["half"] == half)
        assert first["lead ms"] >= 0 and first["tail ms"] is not None
