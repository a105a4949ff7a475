"""The ``radixinfer`` command. Subcommands keep their flags and logic in their own packages; this file only
dispatches.

    radixinfer bench [flags]     streaming benchmark (radixinfer.bench); ``radixinfer bench -h`` for flags
    radixinfer serve [flags]     OpenAI-compatible HTTP server (radixinfer.server)

Under torchrun, rank 0 runs the command and every other rank serves as a tensor-parallel worker of
its engine (docs/multi-gpu.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from radixinfer.bench.args import add_bench_arguments, check_bench_arguments
from radixinfer.distributed.torchrun import torchrun_rank
from radixinfer.server.launch import add_serve_arguments, check_serve_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixinfer", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="streaming benchmark of the engine")
    add_bench_arguments(bench)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(serve)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check; bad flags exit with a usage message (SystemExit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        check_bench_arguments(parser, args)
    if args.command == "serve":
        check_serve_arguments(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if torchrun_rank():  # ranks 1..N-1 of a torchrun launch follow rank 0's engine
        from radixinfer.api import run_tensor_parallel_rank
        from radixinfer.engine_args import llm_kwargs

        run_tensor_parallel_rank(**llm_kwargs(args))
        return 0
    if args.command == "bench":
        from radixinfer.bench.runner import main as bench_main

        bench_main(args)
    if args.command == "serve":
        from radixinfer.server.launch import serve

        serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
