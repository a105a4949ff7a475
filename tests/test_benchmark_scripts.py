"""The benchmark scripts that run on a CPU, at tiny sizes: each finishes and prints its table.

These scripts import the engine's internals (the runner, the cache, the host pool) rather than its
public API, so an internal change can break them without failing any other test; running them here
keeps them working for the GPU runs that need them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = {
    "bench_engine_step.py": (
        ["--device", "cpu", "--batches", "4", "--steps", "3", "--warmup", "1", "--admit-reps", "1"],
        "host time per decode step",
    ),
    "host_step_ab.py": (
        ["--workloads", "hello65", "--repeats", "1", "--rounds", "1"],
        "calls/step",
    ),
    "bench_host_kv.py": (
        ["--device", "cpu", "--model", "tiny", "--blocks", "8", "--pool-blocks", "32"]
        + ["--repeats", "2"],
        '"load_vs_plain"',
    ),
    "bench_skinny_gemm.py": (["--list"], ": rule "),  # the cases only: timing needs CUDA
    "pipe_read_lag.py": (["--frames", "20", "--rate", "200"], "engine pipe reader"),
    "bench_stream_front.py": (
        ["--streams", "8", "--tokens", "6", "--behind", "1", "2", "--repeats", "1"],
        "tokens/chunk",
    ),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_script_runs_at_a_tiny_size_on_the_cpu(script: str):
    args, expected = SCRIPTS[script]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout
