"""Where one forward's GPU time goes: per-kernel times of a decode step or of a prefill (extend) pass at a
fixed shape.

    python benchmarks/profile_forward.py --model qwen2.5-0.5b --batch 512 --context 1216 --shared 1024 --groups 16
    python benchmarks/profile_forward.py --batch 64 --context 1152 --query-len 128   # an extend pass

Builds the model (random weights) and a `ModelRunner` with CUDA graphs, lays out block tables where ``--groups``
groups of sequences share their first ``--shared`` positions (the same physical blocks, as the prefix cache
makes them; ``--shared 0``: every sequence's KV is its own). With ``--query-len 1`` (decode) it

* times the captured decode graphs' replay with CUDA events (median of ``--iters``), the number the engine
  pays: the plain one and the one reading each shared prefix once per tile, side by side on the same batch;
* profiles the same forward run eagerly with `torch.profiler` and prints GPU time per kernel name (summed over
  the layers, per step), so the share of attention, matmuls and the small element-wise kernels is visible.

The decode floor printed beside it is (weight bytes + KV bytes read) / ``--hbm-tbps``, with the KV counted once
per sequence (``--shared 0``) and once per group for the shared part.

With ``--query-len Q > 1`` every sequence computes its last ``Q`` positions in one ragged prefill forward (what
a prefill round of the engine runs when the first ``context - Q`` positions are cached): the forward is timed
with CUDA events and profiled the same way, and its floor is its FLOPs (matmuls over the non-embedding weights,
causal attention over the context, the output projection of one row a sequence) at ``--peak-tflops``: by
default the bf16 matmul rate measured here (`bench_kernels.ceilings`, an 8,192-cube cuBLAS matmul).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import defaultdict

import torch

from radixinfer.attention import get_backend
from radixinfer.bench.bandwidth import cuda_median_s
from radixinfer.engine.decode_bytes import decode_weight_bytes
from radixinfer.engine.kv_store import KVStore
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.models import load_model


def block_tables(
    batch: int, context: int, shared: int, groups: int, block_size: int
) -> list[list[int]]:
    """Sequence ``s`` belongs to group ``s % groups``; a group's sequences share the blocks of the first
    ``shared`` positions (a whole number of blocks), the rest of every table is its own."""
    shared_blocks, total_blocks = shared // block_size, -(-context // block_size)
    next_block = groups * shared_blocks
    tables = []
    for s in range(batch):
        g = s % groups
        own = list(range(next_block, next_block + total_blocks - shared_blocks))
        next_block += len(own)
        tables.append(list(range(g * shared_blocks, (g + 1) * shared_blocks)) + own)
    return tables


def kernel_times(fn, reps: int = 3) -> dict[str, list[float]]:
    """GPU time (µs) and launches per kernel name for one ``fn()``, averaged over ``reps`` profiled calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel[event.name[:90]]
            entry[0] += event.device_time / reps
            entry[1] += 1 / reps
    return per_kernel


def host_profile(fn, top: int, reps: int = 3) -> None:
    """Print the Python functions taking the most host time (cProfile, self time) over ``reps`` calls of
    ``fn()`` followed by a device sync: where the time goes when launching is slower than the GPU."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def print_kernels(per_kernel: dict[str, list[float]], top: int) -> None:
    total = sum(t for t, _ in per_kernel.values())
    print(f"{'kernel':90s} {'us':>9s} {'calls':>6s} {'share':>6s}")
    for name, (t, c) in sorted(per_kernel.items(), key=lambda kv_: -kv_[1][0])[:top]:
        print(f"{name:90s} {t:9.1f} {c:6.0f} {t / total:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--context", type=int, default=1216)
    parser.add_argument("--shared", type=int, default=1024)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument(
        "--query-len", type=int, default=1, help="positions each sequence computes (1 = decode)"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--hbm-tbps", type=float, default=4.8)
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="matmul rate of the prefill floor (default: measured, bench_kernels.ceilings)",
    )
    args = parser.parse_args()

    device = torch.device("cuda")
    loaded = load_model(args.model, device, args.dtype)
    model = loaded.model
    tables = block_tables(args.batch, args.context, args.shared, args.groups, args.block_size)
    num_blocks = max(max(t) for t in tables) + 1
    kv = KVStore(
        model.num_layers,
        num_blocks,
        args.block_size,
        model.num_kv_heads,
        model.head_dim,
        loaded.dtype,
        device,
    )
    kv.k.normal_()
    kv.v.normal_()
    runner = ModelRunner(model, kv, get_backend("cuda"), device, args.batch)
    print(
        f"{args.model} {args.dtype} batch {args.batch} context {args.context} shared {args.shared} x {args.groups}"
        f" groups, query {args.query_len} on {torch.cuda.get_device_name()}"
    )
    if args.query_len > 1:
        if args.peak_tflops is None:
            from bench_kernels import ceilings  # this script's folder: benchmarks/

            args.peak_tflops = ceilings()["matmul_TFLOPs"]
            print(f"bf16 matmul rate for the floor: {args.peak_tflops:.0f} TFLOP/s (measured)")
        profile_prefill(args, model, runner, tables)
    else:
        profile_decode(args, model, runner, tables, kv)


def profile_prefill(
    args: argparse.Namespace, model, runner: ModelRunner, tables: list[list[int]]
) -> None:
    q, c, n, bs = args.query_len, args.context, args.batch, args.block_size
    positions = [p for _ in range(n) for p in range(c - q, c)]
    slots = [t[p // bs] * bs + p % bs for t in tables for p in range(c - q, c)]
    ids = [7] * len(positions)

    def forward() -> None:
        hidden = runner.prefill(ids, positions, slots, tables, [c] * n, [q] * n)
        runner.logits(hidden[q - 1 :: q])

    forward()
    torch.cuda.synchronize()
    us = cuda_median_s(forward, args.iters) * 1e6
    launch_us = []  # host time to enqueue the forward, the device idle before it
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward()
        launch_us.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    per_kernel = kernel_times(forward)
    embed = model.vocab_size * model.hidden_size
    body = sum(p.numel() for p in model.parameters()) - embed * (
        1 if model.config.tie_word_embeddings else 2
    )
    matmul = 2 * body * n * q + 2 * embed * n
    attention = 4 * model.num_layers * model.num_heads * model.head_dim * n * q * (c - (q - 1) / 2)
    floor_us = (matmul + attention) / (args.peak_tflops * 1e6)
    print(
        f"prefill forward {us:.0f} us for {n * q} tokens ({us / (n * q) * 1e3:.0f} ns/token); FLOPs: matmuls "
        f"{matmul / 1e12:.2f} T + attention {attention / 1e12:.2f} T = floor {floor_us:.0f} us at "
        f"{args.peak_tflops:.0f} TFLOP/s ({floor_us / us:.0%} achieved)"
    )
    print(
        f"host time to launch it: {statistics.median(launch_us):.0f} us; GPU kernels alone: "
        f"{sum(t for t, _ in per_kernel.values()):.0f} us"
    )
    print_kernels(per_kernel, args.top)
    host_profile(forward, args.top)


def profile_decode(
    args: argparse.Namespace, model, runner: ModelRunner, tables: list[list[int]], kv
) -> None:
    n = args.batch
    ids, positions = [7] * n, [args.context - 1] * n
    slots = [t[-1] * args.block_size + (args.context - 1) % args.block_size for t in tables]
    contexts = [args.context] * n

    runner.decode(
        ids, positions, slots, tables, contexts
    )  # fills the buffers; plans the shared prefixes
    shared = bool(runner._decode_buffers.tile_lens.any())
    torch.cuda.synchronize()
    # both variants replay on the same buffers: the plain one ignores the planned tiles
    graph_us = {
        variant: cuda_median_s(graph.replay, args.iters) * 1e6
        for (size, variant), (graph, _) in runner.graphs.decode.items()
        if size == n
    }
    per_kernel = kernel_times(lambda: runner._decode_forward(n, args.context, shared))
    eager_us = sum(t for t, _ in per_kernel.values())
    kernels = sum(c for _, c in per_kernel.values())

    weight_bytes = decode_weight_bytes(model)
    per_pos = kv.bytes_per_position
    kv_unique = n * args.context * per_pos
    kv_shared = (args.groups * args.shared + n * (args.context - args.shared)) * per_pos
    floor = lambda b: b / (args.hbm_tbps * 1e6)  # noqa: E731  bytes -> µs
    replays = ", ".join(
        f"{'shared-prefix' if v else 'plain'} {t:.0f} us" for v, t in sorted(graph_us.items())
    )
    print(
        f"graph replay: {replays}; eager kernels ({'shared-prefix' if shared else 'plain'}) {eager_us:.0f} us "
        f"in {kernels:.0f} launches"
    )
    print(
        f"floor: weights {weight_bytes / 1e9:.2f} GB + KV {kv_unique / 1e9:.2f} GB = "
        f"{floor(weight_bytes + kv_unique):.0f}"
        f" us; with each shared prefix read once {floor(weight_bytes + kv_shared):.0f} us"
    )
    print_kernels(per_kernel, args.top)


if __name__ == "__main__":
    main()
