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


@pytest.mark.parametrize("processes", [1, 2])
def test_a_stub_run_prints_both_tables_the_ratio_and_the_server_cpu(tmp_path, processes):
    """One process of each kind, or two API server processes read by two client processes: the
    same requests and tokens either way, and the CPU of every process counted."""
    out = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), "--stub-model", "--num-requests", "8"]
    command += ["--max-new-tokens", "4", "--no-stop-on-eos", "--json", str(out)]
    command += ["--api-server-count", str(processes), "--client-processes", str(processes)]
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
