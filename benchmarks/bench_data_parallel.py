"""Data-parallel replicas against one: M replicas behind one `DataParallelLLM` (the front
``radixinfer serve --data-parallel-size M`` runs) under each router policy, and one replica behind
the same front, through the bench's run loop (no HTTP), one workload.

    python benchmarks/bench_data_parallel.py [radixinfer bench flags] [--data-parallel-size M]
        [--policies cache_aware,round_robin] [--no-single-replica] [--json PATH]

The M replicas open first, each an engine process on its own GPUs (replica r on GPUs
r*TP .. r*TP+TP-1, `radixinfer.data_parallel.replica_processes`); every policy runs on them, in
alternating rounds (the bench's `measure`: warm-ups, then A B, B A, ...). They close, then one
replica opens on the first GPU(s) and runs the same workload. Every measured run starts from empty
prefix caches (``--cold-cache`` is forced), so a policy never reads what another one cached. The
report is the bench's: hit rate, TTFT / TPOT / ITL percentiles, throughput, and the speedups of the
first variant (M replicas, the first policy) over the others.

The GPU measurement (2 GPUs, qwen2.5-0.5b with random weights: 64 system prompts of 1,024 tokens,
16 questions each, all at once; about 5 minutes on two H100s):

    python benchmarks/bench_data_parallel.py --model qwen2.5-0.5b --data-parallel-size 2 \\
        --dataset shared-prefix --num-groups 64 --prompts-per-group 16 --system-prompt-len 1024 \\
        --question-len 64 --max-new-tokens 128 --ignore-eos --max-batch-size 256 \\
        --warmup-runs 1 --repeat-runs 2 --json dp_shared_prefix.json

On a CPU the defaults run the tiny model in seconds (``--dataset shared-prefix`` recommended).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixinfer.bench.args import add_bench_arguments, check_bench_arguments  # noqa: E402
from radixinfer.bench.backends import DataParallelBackend  # noqa: E402
from radixinfer.bench.report import comparisons, format_report  # noqa: E402
from radixinfer.bench.runner import measure  # noqa: E402
from radixinfer.data_parallel import DataParallelLLM, replica_processes  # noqa: E402
from radixinfer.engine_args import llm_kwargs  # noqa: E402
from radixinfer.router import POLICIES  # noqa: E402
from radixinfer.server.launch import (  # noqa: E402
    add_data_parallel_arguments,
    check_data_parallel_arguments,
)


@dataclass(frozen=True)
class Setup:
    """One compared variant: ``replicas`` behind the front, routing by ``policy``."""

    replicas: int
    policy: str
    separate_samples: ClassVar[bool] = False  # each request as the workload has it

    @property
    def label(self) -> str:
        return f"dp={self.replicas} {self.policy}" if self.replicas > 1 else "dp=1"


def _policies(text: str) -> list[str]:
    policies = text.split(",")
    if bad := [p for p in policies if p not in POLICIES]:
        raise argparse.ArgumentTypeError(f"unknown policies {bad}; choose from {POLICIES}")
    return policies


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    add_data_parallel_arguments(parser, default_size=2)
    parser.add_argument(
        "--policies",
        type=_policies,
        default=["cache_aware", "round_robin"],
        metavar="P1,P2",
        help="router policies run on the M replicas, the first also on one replica (this, not "
        "--router-policy, picks them) [cache_aware,round_robin]",
    )
    parser.add_argument(
        "--no-single-replica", action="store_true", help="skip the one-replica baseline"
    )
    args = parser.parse_args(argv)
    check_bench_arguments(parser, args)
    check_data_parallel_arguments(parser, args)
    if args.backend != "radixinfer":
        parser.error("the replicas are radixinfer engines: no --backend")
    args.cold_cache = True  # each run starts empty: no policy reads another's cache
    return args


def run_setups(args: argparse.Namespace, setups: list[Setup]) -> list[dict]:
    """Open ``setups[0].replicas`` replicas, run every setup on them (same replicas, one policy
    each), close them; one result per setup."""
    front = DataParallelLLM(
        replica_processes(llm_kwargs(args), setups[0].replicas),
        load_margin=args.router_load_margin,
    )
    with front:
        backends = [DataParallelBackend(front, setup.policy) for setup in setups]
        return measure(setups, backends, args)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse(argv)
    many = args.data_parallel_size
    runs = run_setups(args, [Setup(many, policy) for policy in args.policies])
    if not args.no_single_replica:
        runs += run_setups(args, [Setup(1, args.policies[0])])
    result = {"config": vars(args), "runs": runs, "comparisons": comparisons(runs)}
    print(format_report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
