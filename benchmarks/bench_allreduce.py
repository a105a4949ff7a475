"""The all-reduce a tensor-parallel decode step makes, measured alone: `TensorParallel.all_reduce`
of ``[batch, hidden]`` bf16 activations (the row-parallel outputs; two per decoder layer), inside a
CUDA graph as the decode step runs them, through each path side by side: ``nccl`` (the device
group) and ``symmetric`` (symmetric memory up to its cap, `radixinfer/distributed/symmetric_memory.py`).

    torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py --hidden 4096 --layers 32 \\
        --batches 1,64 [--paths nccl,symmetric] [--json out.json]

Prints, per path and batch, the median µs of one all-reduce (a graph of 100 back to back,
replayed; the median of 20 replays) and the time a step's ``2 x layers`` all-reduces take, the
term a decode step adds over its weight-read floor at that tensor-parallel size. A path that
cannot run here (symmetric memory on several hosts, say) is reported as NCCL's, with the reason in
the log. Rank 0 prints and writes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from radixinfer.distributed.group import TensorParallel

CALLS_PER_GRAPH = 100
PATHS = ("nccl", "symmetric")


def all_reduce_us(tp: TensorParallel, x: torch.Tensor, replays: int = 20) -> float:
    """Median µs of one in-place ``tp.all_reduce`` of ``x``, from replays of a graph of many."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        for _ in range(3):
            tp.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS_PER_GRAPH):
            tp.all_reduce(x)
    times = []
    for _ in range(replays + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        tp.min_over_ranks(0)  # start together
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    del graph
    torch.cuda.synchronize()
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=8192, help="hidden size [8192: 70B]")
    parser.add_argument("--layers", type=int, default=80, help="decoder layers [80]")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"of {PATHS} [both]")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    paths = args.paths.split(",")
    if not set(paths) <= set(PATHS):
        parser.error(f"--paths: each of {PATHS}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(minutes=5)))
    rows = []
    for path in paths:  # one group per path, each under its own prefix of the store
        prefixed = dist.PrefixStore(path, store)
        tp = TensorParallel.connect(prefixed, rank, world, device, path == "symmetric")
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, args.hidden, dtype=torch.bfloat16, device=device)
            us = all_reduce_us(tp, x)
            symmetric = tp.symmetric is not None and tp.symmetric.fits(x)
            rows.append(
                {
                    "path": path,
                    "batch": batch,
                    "through": "symmetric" if symmetric else "nccl",
                    "all_reduce_us": us,
                    "per_step_us": 2 * args.layers * us,
                }
            )
        tp.close()
    if rank == 0:
        for row in rows:
            print(
                f"TP={world} {row['path']:>9} (through {row['through']:>9}) batch "
                f"{row['batch']:>4}: one all-reduce {row['all_reduce_us']:.1f} µs, "
                f"{2 * args.layers} per step {row['per_step_us']:.0f} µs"
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"world": world, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
