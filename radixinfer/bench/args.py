"""The flags of ``radixinfer bench``.

The flag names of the streaming benchmark radixinfer grew out of (``--prompt``, ``--prompt-repeats``,
``--unique-prompts``, ``--num-requests``, ``--max-new-tokens``, ``--submit-interval-ms``,
``--max-batch-size``, ``--prefill-*``, ``--no-stop-on-eos``, ``--no-prefix-cache``, ``--warmup-runs``,
``--repeat-runs``, ``--model`` = a local HF dir) keep their meaning, so its command lines replay.
Defaults run the built-in tiny model on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from radixinfer.bench.hf import BATCHING_MODES
from radixinfer.bench.workloads import WORKLOADS, parse_repeats
from radixinfer.engine.admission import POLICIES
from radixinfer.engine_args import add_engine_arguments, check_engine_arguments
from radixinfer.sampling_params import SamplingParams

BACKENDS = ("radixinfer", "hf", "openai")


def _policies(text: str) -> list[str]:
    policies = text.split(",")
    if bad := [p for p in policies if p not in POLICIES]:
        raise argparse.ArgumentTypeError(
            f"unknown policies {bad}; choose from {', '.join(POLICIES)}"
        )
    return policies


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)

    backend = parser.add_argument_group("backends and comparisons")
    backend.add_argument(
        "--backend",
        choices=BACKENDS,
        default="radixinfer",
        help="radixinfer, or hf: the same workload through transformers on the "
        "same weights, or openai: through an OpenAI-compatible server at "
        "--base-url [radixinfer]",
    )
    backend.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="openai: the server, e.g. http://127.0.0.1:8000 (API key: $OPENAI_API_KEY)",
    )
    backend.add_argument(
        "--client-processes",
        type=int,
        default=1,
        metavar="K",
        help="openai: streams read by K client processes, each running its share of the sessions, "
        "so one process's reading does not cap what is measured; the report is over every "
        "request [1]",
    )
    backend.add_argument(
        "--compare-backends",
        action="store_true",
        help="run radixinfer and hf side by side (speedups are radixinfer's over hf)",
    )
    backend.add_argument(
        "--compare-no-cache",
        action="store_true",
        help="run with the prefix cache on and off side by side (speedups are on over off)",
    )
    backend.add_argument(
        "--compare-host-cache",
        action="store_true",
        help="run with the host KV tier of --host-cache-gb on and off side by side (speedups are "
        "on over off)",
    )
    backend.add_argument(
        "--compare-separate-samples",
        action="store_true",
        help="run each request's --n completions as one request (one prefill) and as --n separate "
        "requests of one completion side by side (speedups are one request's over the separate "
        "ones'); radixinfer backend",
    )
    backend.add_argument(
        "--compare-policies",
        type=_policies,
        default=None,
        metavar="P1,P2,...",
        help="run each admission policy side by side, e.g. fifo,pack,lpm",
    )
    backend.add_argument(
        "--hf-attn-implementation",
        default="sdpa",
        help="attn_implementation of the transformers model [sdpa]",
    )
    backend.add_argument(
        "--hf-batching",
        choices=BATCHING_MODES,
        default="auto",
        help="continuous (transformers' continuous batching), sequential (generate per request), "
        "auto = continuous when transformers has it [auto]",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--num-requests", type=int, default=32, help="requests (fixed and random datasets) [32]"
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second; inf = all at once [inf]",
    )
    load.add_argument(
        "--submit-interval-ms",
        type=float,
        default=None,
        help="fixed gap between submissions instead",
    )
    load.add_argument(
        "--max-new-tokens",
        "--output-len",
        dest="max_new_tokens",
        type=int,
        default=16,
        help="new tokens per request (random: the maximum) [16]",
    )
    load.add_argument(
        "--ignore-eos",
        "--no-stop-on-eos",
        dest="ignore_eos",
        action="store_true",
        help="always generate --max-new-tokens (random weights never emit EOS on purpose)",
    )
    load.add_argument(
        "--n",
        type=int,
        default=1,
        help="completions per request, sampled off one prefill (SamplingParams.n; radixinfer "
        "backend): tokens, TTFT and end-to-end count all of them, TPOT and ITL take their tokens "
        "as one stream (a step's samples: one arrival) [1]",
    )
    load.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="left-truncate prompts longer than the model context instead of failing",
    )

    add_sampling_arguments(parser)

    runs = parser.add_argument_group("runs and output")
    runs.add_argument(
        "--warmup-runs",
        type=int,
        default=None,
        help="unmeasured runs of the whole workload first [1, or 0 for an engine on the CPU, where "
        "nothing compiles: on a GPU the first run compiles kernels and captures graphs, which "
        "would fall on the first variant of a comparison]",
    )
    runs.add_argument(
        "--repeat-runs", type=int, default=1, help="measured runs, pooled in the report [1]"
    )
    runs.add_argument(
        "--cold-cache", action="store_true", help="empty the prefix cache before each measured run"
    )
    runs.add_argument(
        "--gc-threshold",
        type=int,
        default=50_000,
        metavar="N",
        help="the garbage collector's young-generation threshold while the bench runs, as a serving "
        "process would set it (Python's default: 700; 0 leaves it alone) [50000]",
    )
    runs.add_argument(
        "--json", default=None, metavar="PATH", help="also write every metric as JSON to PATH"
    )
    runs.add_argument(
        "--hbm-tbps",
        type=float,
        default=None,
        metavar="TB/S",
        help="memory bandwidth of the decode floor the report shows beside the inter-token latency "
        "(what a decode step reads at the least over it) [measured on a CUDA device; else no floor]",
    )

    data = parser.add_argument_group("workloads")
    data.add_argument("--dataset", choices=tuple(WORKLOADS), default="fixed", help="[fixed]")
    data.add_argument("--prompt", default="Hello", help="fixed: the text to repeat [Hello]")
    data.add_argument(
        "--prompt-repeats",
        default="16",
        help="fixed: repeats, or a list like 512,1,1,1 cycled over requests [16]",
    )
    data.add_argument(
        "--unique-prompts", action="store_true", help='fixed: append " [i]" to request i\'s prompt'
    )
    data.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="random: max prompt length; multi-turn: first turn [128]",
    )
    data.add_argument(
        "--range-ratio",
        type=float,
        default=1.0,
        help="random: lengths uniform in [len * ratio, len] (1.0 = exact) [1.0]",
    )
    data.add_argument("--num-groups", type=int, default=4, help="shared-prefix: system prompts [4]")
    data.add_argument(
        "--prompts-per-group",
        type=int,
        default=8,
        help="shared-prefix: questions per system prompt [8]",
    )
    data.add_argument(
        "--system-prompt-len", type=int, default=256, help="shared-prefix: tokens [256]"
    )
    data.add_argument("--question-len", type=int, default=32, help="shared-prefix: tokens [32]")
    data.add_argument(
        "--num-conversations", type=int, default=8, help="multi-turn: conversations [8]"
    )
    data.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation [3]")
    data.add_argument(
        "--turn-len", type=int, default=32, help="multi-turn: new user tokens per later turn [32]"
    )
    data.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="multi-turn: mean seconds between an answer and the next turn (exponential); 0 = at "
        "once [0]",
    )


# flag -> (SamplingParams field, type, default): how every request of the bench samples
SAMPLING_FLAGS = {
    "--temperature": ("temperature", float, 0.0),
    "--top-p": ("top_p", float, 1.0),
    "--top-k": ("top_k", int, 0),
    "--min-p": ("min_p", float, 0.0),
    "--presence-penalty": ("presence_penalty", float, 0.0),
    "--frequency-penalty": ("frequency_penalty", float, 0.0),
    "--repetition-penalty": ("repetition_penalty", float, 1.0),
}


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """How every request samples (SamplingParams' fields of the same names; the default is greedy),
    so sampled traffic is measured like greedy traffic."""
    group = parser.add_argument_group("sampling (every request; default greedy)")
    for flag, (field, kind, default) in SAMPLING_FLAGS.items():
        group.add_argument(flag, dest=field, type=kind, default=default, help=f"[{default}]")


def sampling_fields(args: argparse.Namespace) -> dict[str, float | int]:
    """The bench's sampling flags as `SamplingParams` keyword arguments."""
    return {field: getattr(args, field) for field, _, _ in SAMPLING_FLAGS.values()}


def _check_sampling(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The sampling flags as `SamplingParams` checks them, the error naming the flag; and refused
    with the transformers backend, which the bench runs greedily."""
    fields = sampling_fields(args)
    try:
        SamplingParams(**fields)
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        parser.error(f"--{field.replace('_', '-')} {rest}")
    sampled = fields != {field: default for field, _, default in SAMPLING_FLAGS.values()}
    if sampled and (args.backend == "hf" or args.compare_backends):
        parser.error("the hf backend decodes greedily: sampling flags go with radixinfer or openai")


def default_warmup_runs(args: argparse.Namespace) -> int:
    """``--warmup-runs`` when not given: 0 where this process runs the engine on the CPU (nothing
    compiles, and the quickstart stays quick), else 1 (a GPU engine's first run compiles its kernels,
    and a server's may too, which would bias a comparison against its first variant)."""
    return 0 if args.backend != "openai" and args.device == "cpu" else 1


def check_bench_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag checks argparse cannot express; errors exit through ``parser.error``."""
    if args.submit_interval_ms is not None and not math.isinf(args.request_rate):
        parser.error("give --request-rate or --submit-interval-ms, not both")
    if args.request_rate <= 0:
        parser.error("--request-rate must be > 0")
    if not args.think_time >= 0:
        parser.error("--think-time must be >= 0")
    if (args.backend == "openai") != (args.base_url is not None):
        parser.error("--backend openai and --base-url go together")
    if args.client_processes < 1:
        parser.error("--client-processes must be >= 1")
    if args.client_processes > 1 and args.backend != "openai":
        parser.error("--client-processes > 1 goes with --backend openai")
    comparing = (
        args.compare_backends
        or args.compare_no_cache
        or args.compare_policies
        or args.compare_host_cache
        or args.compare_separate_samples
    )
    if args.compare_host_cache and not args.host_cache_gb:
        parser.error("--compare-host-cache needs --host-cache-gb > 0 (the tier it turns on)")
    if args.backend == "openai" and comparing:
        parser.error("--backend openai compares nothing: the server's settings are its own")
    if args.gc_threshold < 0:
        parser.error("--gc-threshold must be >= 0")
    if args.hbm_tbps is not None and not args.hbm_tbps > 0:
        parser.error("--hbm-tbps must be > 0")
    if args.warmup_runs is None:
        args.warmup_runs = default_warmup_runs(args)
    if args.warmup_runs < 0 or args.repeat_runs < 1:
        parser.error("--warmup-runs must be >= 0 and --repeat-runs >= 1")
    for name in (
        "num_requests",
        "max_new_tokens",
        "input_len",
        "num_groups",
        "prompts_per_group",
        "question_len",
        "num_conversations",
        "turns",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.n < 1:
        parser.error("--n must be >= 1")
    if args.n > 1 and (args.backend != "radixinfer" or args.compare_backends):
        parser.error("--n > 1 runs on the radixinfer backend only")
    if args.compare_separate_samples and args.n < 2:
        parser.error("--compare-separate-samples needs --n > 1 (the completions it splits)")
    if not 0.0 <= args.range_ratio <= 1.0:
        parser.error("--range-ratio must be in [0, 1]")
    try:
        parse_repeats(args.prompt_repeats)
    except ValueError as exc:
        parser.error(str(exc))
    _check_sampling(parser, args)
    check_engine_arguments(parser, args)
    if args.json is not None:
        _check_writable(parser, "--json", Path(args.json))


def _check_writable(parser: argparse.ArgumentParser, flag: str, path: Path) -> None:
    """Fail now, not after the run, when ``path`` cannot be written (a file the check creates is removed)."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        parser.error(f"{flag} {path}: cannot write there ({exc.strerror})")
    if not existed:
        path.unlink()


def parse_bench_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and cross-check one ``radixinfer bench`` command line (the flags only, no subcommand), as the
    ``radixinfer`` command does; bad flags exit with a usage message (SystemExit 2)."""
    parser = argparse.ArgumentParser(prog="radixinfer bench")
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    check_bench_arguments(parser, args)
    return args
