"""Run many ``radixinfer bench`` command lines in one process (``benchmarks/gpu_suite.sh`` feeds it).

    python -m radixinfer.bench.suite OUT_DIR < runs.txt      # each line: NAME FLAGS... (as for `radixinfer bench`)

One process pays for importing torch and transformers, and for CUDA and Triton start-up, once instead of
once per run. Each run goes through the same parser and `run_bench` as the CLI and writes
``OUT_DIR/NAME.json`` and ``OUT_DIR/NAME.txt``. A run that fails, or passes ``--run-timeout`` seconds, is
reported and skipped; the exit status is the number of failed runs. A summary table closes the output.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from radixinfer.bench import runner
from radixinfer.bench.args import parse_bench_args
from radixinfer.bench.report import format_report, summary_table


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in the main thread after ``seconds`` (the benchmark waits there; closing the
    backend afterwards aborts whatever is still running)."""

    def expire(signum, frame):
        raise TimeoutError(f"run took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_lines(lines: list[str], out_dir: Path, run_timeout: int) -> int:
    """Run each ``NAME FLAGS...`` line; returns the number that failed."""
    results, failed = {}, 0
    for line in lines:
        name, *flags = shlex.split(line)
        print(f"== {name}: radixinfer bench {shlex.join(flags)}", flush=True)
        try:
            args = parse_bench_args([*flags, "--json", str(out_dir / f"{name}.json")])
            with _time_limit(run_timeout):
                result = runner.main(args)
        except (Exception, SystemExit):  # noqa: BLE001 - one bad run must not stop the suite
            traceback.print_exc()
            print(f"!! {name} failed", flush=True)
            failed += 1
            continue
        (out_dir / f"{name}.txt").write_text(format_report(result) + "\n")
        results[name] = result
    if results:
        summary = summary_table(results)
        print(
            "== summary (latencies in ms; last column: output-throughput speedup of each run's first variant)"
        )
        print(summary)
        (out_dir / "summary.txt").write_text(summary + "\n")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--run-timeout", type=int, default=600, help="seconds per run [600]")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        line
        for line in sys.stdin.read().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return run_lines(lines, args.out_dir, args.run_timeout)


if __name__ == "__main__":
    sys.exit(main())
