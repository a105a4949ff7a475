"""Where a decode step of the shared-prefix benchmark's batch goes, with the real engine stepped directly.

    PYTHONPATH=. python benchmarks/profile_engine_decode.py [--model qwen2.5-0.5b --groups 16 --per-group 32]

Admits ``groups x per-group`` requests (each group's 1,024-token system prompt plus a 128-token question,
128 new tokens, ids only) into an `api.LLM` on CUDA, steps until every request decodes, then over 30
decode-only steps reports the engine step's host time (median) and the host time of each CUDA graph replay,
and over 20 more under `torch.profiler` the wall time against the GPU time of every kernel and copy, the
host calls that took longest (``cudaEventSynchronize`` is the host waiting for the GPU) and the kernels.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from radixinfer import LLM, SamplingParams
from radixinfer.engine.request import Status


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=32)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    batch = args.groups * args.per_group
    llm = LLM(args.model, device="cuda", dtype=args.dtype, max_batch_size=batch, freeze_gc=True)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=128, ignore_eos=True, detokenize=False)
    for _ in range(args.groups):
        system = [rng.randrange(1000, 100000) for _ in range(1024)]
        for _ in range(args.per_group):
            engine.add_request(system + [rng.randrange(1000, 100000) for _ in range(128)], params)
    while engine.waiting or any(r.status is not Status.RUNNING for r in engine.active):
        engine.step()
    for _ in range(5):
        engine.step()

    replay_us: list[float] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph: torch.cuda.CUDAGraph) -> None:
        start = time.perf_counter()
        replay(graph)
        replay_us.append((time.perf_counter() - start) * 1e6)

    step_us = []
    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        for _ in range(30):
            start = time.perf_counter()
            engine.step()
            step_us.append((time.perf_counter() - start) * 1e6)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    print(
        f"{torch.cuda.get_device_name()}, {args.model} batch {batch}: engine step "
        f"{statistics.median(step_us):.0f} us (median of 30), graph replay host time "
        f"{statistics.median(replay_us):.0f} us"
    )

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"20 steps: wall {wall_us:.0f} us, GPU (kernels and copies) {gpu_us:.0f} us")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    print(events.table(sort_by="self_device_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
