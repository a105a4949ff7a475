"""``radixinfer bench`` end to end on the CPU with the tiny model: defaults, every metric in the JSON,
shared-prefix hit rates with and without the cache, the transformers baseline (same greedy tokens as
radixinfer on the same weights), and the GPU suite script in its SMOKE mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixinfer.bench.hf import export_checkpoint
from radixinfer.bench.run_loop import run_workload
from radixinfer.bench.runner import Variant, open_backend
from radixinfer.bench.workloads import build_workload
from radixinfer.cli import main, parse_args

REPO = Path(__file__).resolve().parents[1]
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
COUNTS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "computed_prompt_tokens",
    "hit_rate",
    "completion_tokens",
)
THROUGHPUTS = ("output_throughput", "total_throughput", "request_throughput", "wall_s")


def bench(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "result.json"
    assert main(["bench", *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_defaults_run_on_cpu_and_the_json_holds_every_metric(tmp_path, capsys):
    result = bench(tmp_path)
    (run,) = result["runs"]
    metrics = run["metrics"]
    assert run["backend"] == "radixinfer" and result["config"]["device"] == "cpu"
    for key in COUNTS + THROUGHPUTS:
        assert metrics[key] is not None, key
    for key in LATENCIES:
        assert (
            set(metrics[key]) == {"mean", "p50", "p95", "p99"} and None not in metrics[key].values()
        ), key
    assert metrics["requests"] == 32 and metrics["completion_tokens"] <= 32 * 16
    # no bandwidth on a CPU unless given: the decode steps' bytes, no floor
    assert metrics["decode_read_mb"] > 0 and metrics["decode_floor_ms"] is None
    assert "ttft_ms p99" in capsys.readouterr().out


def test_sampled_traffic_is_benchmarked_like_greedy(tmp_path):
    flags = ["--num-requests", "8", "--max-new-tokens", "6", "--ignore-eos"]
    sampled = ["--temperature", "0.8", "--top-p", "0.95", "--min-p", "0.05"]
    sampled += ["--frequency-penalty", "0.5"]
    (run,) = bench(tmp_path, *flags, *sampled)["runs"]
    assert run["metrics"]["completion_tokens"] == 8 * 6


def test_shared_prefix_hits_with_the_cache_and_never_without(tmp_path):
    result = bench(
        tmp_path,
        "--dataset",
        "shared-prefix",
        "--num-groups",
        "2",
        "--prompts-per-group",
        "8",
        "--system-prompt-len",
        "256",
        "--question-len",
        "8",
        "--output-len",
        "2",
        "--compare-no-cache",
        "--hbm-tbps",
        "0.5",
    )
    on, off = (run["metrics"] for run in result["runs"])
    assert on["hit_rate"] > 0.8
    for metrics in (on, off):  # each step's floor at the given bandwidth, beside the latency
        assert metrics["decode_floor_ms"] == pytest.approx(metrics["decode_read_mb"] / 500)
        assert metrics["decode_floor_of_itl"] == pytest.approx(
            metrics["decode_floor_ms"] / metrics["itl_ms"]["p50"]
        )
    assert result["config"]["hbm_tbps"] == 0.5
    assert (
        off["hit_rate"] == 0
        and off["cached_tokens"] == 0
        and off["computed_prompt_tokens"] == off["prompt_tokens"]
    )
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"]
    assert result["comparisons"][0]["other"] == "radixinfer cache=off fifo"


def test_n_completions_per_request_compute_each_prompt_once(tmp_path):
    flags = ["--num-requests", "4", "--input-len", "24", "--output-len", "3", "--ignore-eos"]
    result = bench(tmp_path, *flags, "--n", "4", "--no-prefix-cache")
    metrics = result["runs"][0]["metrics"]
    assert metrics["requests"] == 4 and metrics["completion_tokens"] == 4 * 4 * 3
    assert metrics["computed_prompt_tokens"] == metrics["prompt_tokens"]  # once per request


def test_n_completions_run_beside_as_many_separate_requests(tmp_path):
    """One command: the shared-prefix workload with n=4 against each request sent as 4 requests,
    with the prompt tokens computed, TTFT and throughput of each and the speedups."""
    flags = ["--dataset", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "2"]
    flags += ["--system-prompt-len", "32", "--question-len", "8", "--output-len", "3"]
    flags += ["--ignore-eos", "--temperature", "0.8", "--cold-cache"]
    result = bench(tmp_path, *flags, "--n", "4", "--compare-separate-samples")
    together, separate = (run["metrics"] for run in result["runs"])
    assert together["requests"] == 4 and separate["requests"] == 16
    assert together["completion_tokens"] == separate["completion_tokens"] == 16 * 3
    assert separate["prompt_tokens"] == 4 * together["prompt_tokens"]
    assert together["computed_prompt_tokens"] <= separate["computed_prompt_tokens"]
    assert together["ttft_ms"]["p50"] > 0 and separate["ttft_ms"]["p50"] > 0
    (comparison,) = result["comparisons"]
    assert comparison["other"] == "radixinfer cache=on samples=separate fifo"
    assert comparison["speedup"]


def test_hf_backend_runs_beside_radixinfer(tmp_path):
    result = bench(
        tmp_path,
        "--compare-backends",
        "--num-requests",
        "4",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--unique-prompts",
        "--repeat-runs",
        "2",
        "--cold-cache",
    )
    radix, hf = result["runs"]
    assert hf["backend"] == "hf" and hf["metrics"]["cached_tokens"] is None
    assert hf["metrics"]["completion_tokens"] == radix["metrics"]["completion_tokens"] == 2 * 4 * 4
    assert hf["metrics"]["prompt_tokens"] == radix["metrics"]["prompt_tokens"]
    assert len(hf["repeats"]) == 2 and hf["metrics"]["ttft_ms"]["p50"] > 0


@pytest.mark.parametrize("batching", ["continuous", "sequential"])
def test_hf_baseline_produces_radixinfers_greedy_tokens(tmp_path, batching):
    args = parse_args(
        [
            "bench",
            "--num-requests",
            "3",
            "--unique-prompts",
            "--ignore-eos",
            "--max-new-tokens",
            "6",
            "--hf-batching",
            batching,
        ]
    )
    model = str(export_checkpoint("tiny", tmp_path, "cpu", "auto", seed=0))
    outputs = []
    for variant in (Variant("radixinfer", True, "fifo"), Variant("hf", True, None)):
        backend = open_backend(variant, model, args, args.gpu_memory_utilization)
        try:
            sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
            records, _ = run_workload(backend, sessions, [0.0] * len(sessions), args, variant.label)
        finally:
            backend.close()
        outputs.append(sorted((r.prompt_len, r.token_ids) for r in records))
    assert outputs[0] == outputs[1]


def run_smoke(script: str, out: Path, timeout: float, **env: str) -> None:
    """``benchmarks/<script>`` in its CPU smoke mode, writing to ``out``; it must succeed."""
    env = {
        **os.environ,
        **env,
        "SMOKE": "1",
        "OUT": str(out),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_gpu_suite_smoke_mode(tmp_path):
    out = tmp_path / "suite"
    run_smoke("gpu_suite.sh", out, timeout=300)
    names = [
        "fixed_hello65",
        "shared_prompt",
        "head_of_line",
        "shared_prefix_cache",
        "shared_prefix_vs_hf",
        "random_cache_cost",
    ]
    for name in names:
        result = json.loads((out / f"{name}.json").read_text())
        assert all(run["metrics"]["requests"] > 0 for run in result["runs"]), name
    labels = [run["label"] for run in json.loads((out / "head_of_line.json").read_text())["runs"]]
    assert labels == [f"radixinfer cache=off {p}" for p in ("fifo", "pack", "lpm")]
    summary = (out / "summary.txt").read_text()
    assert all(name in summary for name in names) and "hf cache=on" in summary


def test_scale_out_smoke_mode(tmp_path):
    """The 4-GPU script's plumbing on a CPU (tiny model, two ranks or replicas): a tensor-parallel
    decode step, a served data-parallel run and TP x DP, each writing its JSON."""
    out = tmp_path / "scale"
    run_smoke("scale_out.sh", out, timeout=400, ONLY="decode_70b dp4_served_cache tp2_dp2")
    step = json.loads((out / "decode_70b_tp4.json").read_text())
    rows = next(v for k, v in step.items() if k.startswith("model_decode:"))
    assert rows and all("error" not in row for row in rows)
    for name in ("dp4_served_cache_aware", "tp2_dp2"):
        result = json.loads((out / f"{name}.json").read_text())
        assert all(run["metrics"]["requests"] > 0 for run in result["runs"]), name
