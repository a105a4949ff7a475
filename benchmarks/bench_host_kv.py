"""Host-to-device and device-to-host bandwidth of the host KV tier's copies, against a plain
``copy_`` of the same bytes between one pinned host tensor and one device tensor.

    python benchmarks/bench_host_kv.py [--model qwen2.5-0.5b] [--blocks 512] [--json PATH]

The KV pool and the host pool are shaped as the engine shapes them for ``--model`` (a preset: its
layers, KV heads and head size; bf16 on CUDA, float32 on a CPU), ``--pool-blocks`` GPU blocks and
``--blocks`` host blocks. One measured load moves ``--blocks`` blocks from the host pool into a
random permutation of GPU blocks (as fragmented as a long-running server's pool), ``--run-length``
consecutive host blocks per run; an offload moves them back. Times are medians over ``--repeats``
runs, each synchronised at both ends (CUDA events on a GPU, wall time elsewhere); bandwidth is KV
bytes moved over that time, and the ratio is against the plain copy of as many bytes (the bus's own
rate here). The engine does not wait for loads (`radixinfer.engine.host_kv`), so a load is timed as
the engine times it, by the pool's own events around its copies on the side stream (``load``), and
also from queueing to completion, the host's work included (``load_end_to_end``).

The whole proof of the host tier on a GPU is this and `radixinfer bench` runs, each pair of runs
under 5 minutes on an H200 (random bf16 weights). llama-3.1-8b is where the tier should win: its KV is
~131 KB a token (2 MiB a block of 16), and computing a history again costs ~10x its load over the
bus; qwen2.5-0.5b computes a history again in milliseconds.

    # multi-turn chat, 128 conversations x 8 turns (512-token first message and turns, 64-token
    # answers), all started at once, each user thinking an exponential 1.1 s on average between an
    # answer and the next turn: the pool (6,144 blocks of 16 = 98k tokens) holds a fraction of the
    # running turns, and while a user thinks the other conversations' turns evict the history from
    # the GPU; the histories end at 128 x 4,608 = 590k tokens (6x the pool, 72 GiB of KV: the host
    # tier holds all of it). Off, every turn computes its history again (4.8x the prompt tokens of
    # on). Host tier on vs off: hit rate, TTFT p50/p99 (every turn's), throughput, load_gb_per_s
    radixinfer bench --model llama-3.1-8b --dtype bfloat16 --dataset multi-turn \
        --num-conversations 128 --turns 8 --input-len 512 --turn-len 512 --max-new-tokens 64 \
        --ignore-eos --max-num-seqs 128 --max-batch-size 128 --num-blocks 6144 --think-time 1.1 \
        --host-cache-gb 72 --compare-host-cache --json host_multi_turn_llama.json
    # the copies alone: load bandwidth vs a plain pinned copy_ of the same bytes (1 GiB moved)
    python benchmarks/bench_host_kv.py --model llama-3.1-8b --json host_copies_llama.json
    # the cost when nothing is reused: random prompts, a pool of about the running batch's KV, so
    # every admission evicts finished requests' KV and writes it back (the host tier fills and
    # evicts on its own too); host tier on vs off, two rounds each
    radixinfer bench --model llama-3.1-8b --dtype bfloat16 --dataset random --num-requests 384 \
        --input-len 1024 --max-new-tokens 128 --ignore-eos --num-blocks 6000 --host-cache-gb 16 \
        --compare-host-cache --repeat-runs 2 --json host_no_reuse_llama.json
    radixinfer bench --model qwen2.5-0.5b --dtype bfloat16 --dataset random --num-requests 1024 \
        --input-len 1024 --max-new-tokens 128 --ignore-eos --num-blocks 4000 --host-cache-gb 4 \
        --compare-host-cache --repeat-runs 2 --json host_no_reuse_qwen.json

The same multi-turn chats on qwen2.5-0.5b (`--model qwen2.5-0.5b`, `--host-cache-gb 8`; its KV is
12 KB a token) show what the tier is worth where recomputing is cheap.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixinfer.cache.host_tier import TransferBatch  # noqa: E402
from radixinfer.engine.host_kv import HostKVPool  # noqa: E402
from radixinfer.models.presets import preset_config  # noqa: E402


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (after one warm-up), synchronised at both
    ends."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _load_seconds(
    host: HostKVPool,
    load: list[TransferBatch],
    k: torch.Tensor,
    v: torch.Tensor,
    tickets: Iterator[int],
    repeats: int,
) -> float:
    """Median seconds of one run of ``load`` as the pool times its loads (the engine's
    ``load_seconds``: events around the copies on the side stream, or wall time on a CPU)."""
    times = []
    for _ in range(repeats):
        before = host.load_seconds
        host.run(load, k, v, next(tickets))
        host.finished_ticket(wait=True)
        times.append(host.load_seconds - before)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", help="preset whose KV shape is used")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=512, help="blocks moved per measured copy")
    parser.add_argument("--pool-blocks", type=int, default=4096, help="GPU KV pool, in blocks")
    parser.add_argument("--run-length", type=int, default=8, help="consecutive host blocks per run")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not 1 <= args.blocks <= args.pool_blocks:
        parser.error("--blocks must be in [1, --pool-blocks]")
    device = torch.device(args.device)
    config = preset_config(args.model)
    num_kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (config.num_hidden_layers, args.pool_blocks, args.block_size, num_kv_heads, head_dim)
    k = torch.zeros(shape, dtype=dtype, device=device)
    v = torch.zeros(shape, dtype=dtype, device=device)
    host = HostKVPool(args.blocks, k, args.blocks)  # every write-back gathered at once
    rng = random.Random(0)
    gpu_ids = rng.sample(range(args.pool_blocks), args.blocks)
    step = args.run_length
    runs = [list(range(i, min(i + step, args.blocks))) for i in range(0, args.blocks, step)]
    rng.shuffle(runs)  # runs in a random order, consecutive inside each
    host_ids = [b for run in runs for b in run]
    load = [TransferBatch(False, host_ids, gpu_ids)]
    offload = [TransferBatch(True, gpu_ids, host_ids)]
    tickets = itertools.count(1)

    def load_to_end() -> None:  # queue the loads, then wait for them as a request does
        host.run(load, k, v, next(tickets))
        host.finished_ticket(wait=True)

    shape = (host.num_blocks, *host.block_shape)
    plain_src = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
    plain_dst = torch.empty(shape, dtype=dtype, device=device)
    nbytes = host.num_blocks * host.block_bytes

    measured = {
        "load_end_to_end": load_to_end,
        "offload": lambda: (host.run(offload, k, v, next(tickets)), host.join()),
        "plain_h2d": lambda: plain_dst.copy_(plain_src, non_blocking=True),
        "plain_d2h": lambda: plain_src.copy_(plain_dst, non_blocking=True),
    }
    seconds = {name: _timed(fn, device, args.repeats) for name, fn in measured.items()}
    seconds["load"] = _load_seconds(host, load, k, v, tickets, args.repeats)
    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "blocks": args.blocks,
        "run_length": args.run_length,
        "bytes": nbytes,
        "seconds": seconds,
        "GB_per_s": gbps,
        "load_vs_plain": gbps["load"] / gbps["plain_h2d"],
        "offload_vs_plain": gbps["offload"] / gbps["plain_d2h"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
