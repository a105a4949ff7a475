"""The model and engine flags shared by ``radixinfer bench`` and ``radixinfer serve``: one definition
of each flag, one check, and one mapping onto `LLM`'s arguments."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from radixinfer import checks
from radixinfer.engine.admission import POLICIES
from radixinfer.models import DTYPE_NAMES, checkpoint_dir


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``model and engine`` flag group."""
    model = parser.add_argument_group("model and engine")
    model.add_argument(
        "--model", default="tiny", help="preset name or local HF checkpoint dir [tiny]"
    )
    model.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="[cuda when available, else cpu]",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_NAMES,
        metavar="DTYPE",
        help="auto | float32 | bfloat16 | float16 (or bf16, fp16, fp32, half) [auto]",
    )
    model.add_argument("--block-size", type=int, default=16, help="tokens per KV block [16]")
    model.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks (default: what --gpu-memory-utilization leaves after "
        "weights, activations and CUDA graphs)",
    )
    model.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the whole GPU the engine may use (the bench's compared "
        "variants are open at once and each takes an equal share) [0.9]",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output served, and what context-sized workspaces "
        "are sized for [the model's context]",
    )
    model.add_argument(
        "--max-batch-size", type=int, default=64, help="sequences decoded per step [64]"
    )
    model.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="requests holding KV at once [unbounded: KV memory decides]",
    )
    model.add_argument(
        "--prefill-max-batch-size",
        type=int,
        default=None,
        help="requests admitted per prefill round [--max-batch-size]",
    )
    model.add_argument(
        "--prefill-max-tokens",
        type=int,
        default=8192,
        help="uncached prompt tokens per prefill round; longer prompts are chunked [8192]",
    )
    model.add_argument(
        "--prefill-admission-policy", choices=POLICIES, default="fifo", help="[fifo]"
    )
    model.add_argument(
        "--prefill-admission-lookahead",
        type=int,
        default=64,
        help="waiting requests pack / lpm look at [64]",
    )
    model.add_argument(
        "--prefill-force-fifo-every",
        type=int,
        default=0,
        help="every N-th round is fifo, so pack / lpm cannot starve a long prompt (0 = never) [0]",
    )
    model.add_argument(
        "--no-chunked-prefill", action="store_true", help="run an over-budget prompt alone instead"
    )
    model.add_argument(
        "--decode-first", action="store_true", help="run the decode step before each prefill round"
    )
    model.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    model.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over this many GPUs (processes on a CPU); under torchrun, its "
        "WORLD_SIZE (docs/multi-gpu.md) [1]",
    )
    model.add_argument(
        "--host-cache-gb",
        type=float,
        default=0.0,
        help="GiB of host memory for a second KV tier under the GPU pool: evicted prefixes are "
        "written back there and loaded back on reuse (0 = none) [0]",
    )
    model.add_argument(
        "--host-write-through-hits",
        type=int,
        default=None,
        metavar="K",
        help="with --host-cache-gb: copy a prefix to the host tier while still on the GPU once "
        "more than K prompts matched it, so its eviction moves nothing [off]",
    )
    model.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random weights of presets, sampling seeds (and the bench's workload "
        "and arrivals) [0]",
    )


def check_engine_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The model and engine flags, checked before anything loads: a bad one is a usage error."""
    for name, low in (
        ("block_size", 1),
        ("max_batch_size", 1),
        ("prefill_max_tokens", 1),
        ("prefill_admission_lookahead", 1),
        ("num_blocks", 1),
        ("max_num_seqs", 1),
        ("prefill_max_batch_size", 1),
        ("prefill_force_fifo_every", 0),
        ("seed", 0),
        ("max_model_len", 1),
        ("tensor_parallel_size", 1),
        ("host_write_through_hits", 0),
    ):
        value = getattr(args, name)
        if value is not None and value < low:  # None: the flag's default, left to the engine
            parser.error(f"--{name.replace('_', '-')} must be >= {low}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error("--gpu-memory-utilization must be in (0, 1]")
    if not 0.0 <= args.host_cache_gb < float("inf"):
        parser.error("--host-cache-gb must be a number >= 0")
    if args.host_cache_gb and args.no_prefix_cache:
        parser.error("--host-cache-gb needs the prefix cache (drop --no-prefix-cache)")
    if args.host_write_through_hits is not None and not args.host_cache_gb:
        parser.error("--host-write-through-hits needs --host-cache-gb > 0")
    try:
        checks.device(args.device)
        checkpoint_dir(args.model)
    except ValueError as exc:  # their messages start with the argument's name
        parser.error(f"--{exc}")


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM`'s arguments from the flags (``model`` included). Both users (a benchmark, a server)
    are long-running front ends, so the process's objects are frozen (``freeze_gc``)."""
    return dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_size=args.max_batch_size,
        enable_prefix_cache=not args.no_prefix_cache,
        seed=args.seed,
        prefill_max_batch_size=args.prefill_max_batch_size,
        prefill_max_tokens=args.prefill_max_tokens,
        prefill_admission_policy=args.prefill_admission_policy,
        prefill_admission_lookahead=args.prefill_admission_lookahead,
        prefill_force_fifo_every=args.prefill_force_fifo_every,
        chunked_prefill=not args.no_chunked_prefill,
        decode_first=args.decode_first,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        host_cache_gb=args.host_cache_gb,
        host_write_through_hits=args.host_write_through_hits,
        freeze_gc=True,
        tensor_parallel_size=args.tensor_parallel_size,
    )
