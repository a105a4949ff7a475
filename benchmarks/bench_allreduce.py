"""The all-reduce a tensor-parallel decode step makes, measured alone: NCCL all-reduces of
``[batch, hidden]`` bf16 activations (the row-parallel outputs; two per decoder layer), inside a
CUDA graph as the decode step runs them.

    torchrun --nproc-per-node 4 benchmarks/bench_allreduce.py --hidden 8192 --layers 80 \\
        --batches 1,32,128 [--json out.json]

Prints, per batch, the median µs of one all-reduce (a graph of 100 back to back, replayed; the
median of 20 replays) and the time a step's ``2 x layers`` all-reduces take, the term a decode
step adds over its weight-read floor at that tensor-parallel size. Rank 0 prints and writes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

CALLS_PER_GRAPH = 100


def all_reduce_us(x: torch.Tensor, replays: int = 20) -> float:
    """Median µs of one in-place all-reduce of ``x``, from replays of a graph of many."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # NCCL warm-up outside the capture
        for _ in range(3):
            dist.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS_PER_GRAPH):
            dist.all_reduce(x)
    times = []
    for _ in range(replays + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=8192, help="hidden size [8192: 70B]")
    parser.add_argument("--layers", type=int, default=80, help="decoder layers [80]")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.randn(batch, args.hidden, dtype=torch.bfloat16, device="cuda")
        us = all_reduce_us(x)
        rows.append({"batch": batch, "all_reduce_us": us, "per_step_us": 2 * args.layers * us})
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        for row in rows:
            print(
                f"TP={world} batch {row['batch']:>4}: one all-reduce {row['all_reduce_us']:.1f} µs, "
                f"{2 * args.layers} per step {row['per_step_us']:.0f} µs"
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"world": world, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
