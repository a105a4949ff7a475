"""Where a decode step's GPU time goes: the kernels of one generation under `torch.profiler`, by
name, with the all-reduces' spread (a rank waiting for another shows as a long all-reduce).

    python benchmarks/profile_decode.py --model llama-3.1-8b [--tensor-parallel-size 2]
        [--batch 1] [--prompt-len 600] [--output-len 64]

Needs CUDA. Random bf16 weights; ``--batch`` distinct prompts of ``--prompt-len`` tokens, each
``--output-len`` new tokens (EOS ignored), generated twice to warm up, then once timed and once
profiled. With tensor parallelism the kernels are rank 0's. Prints the wall time per decode step
(the timed generation over its output length, prefill included), each kernel's total, count and
median, and the NCCL kernels' median, p99 and the time spent in those above 40 µs.

Under programmatic dependent launch (`kernels/pdl.py`, on by default on Hopper) a kernel starts while the one
before it runs and waits for it inside, so each kernel's time includes that wait and the totals add up to
more than the step (an H200, qwen2.5-0.5b at batch 1: 1,883 µs of kernels in a 783 µs step). Run with
``RADIXINFER_PDL=0`` for each kernel's own time (the step then runs without the overlap).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from radixinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--top", type=int, default=16, help="kernels listed")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        device="cuda",
        dtype="bfloat16",
        max_batch_size=max(8, args.batch),
        tensor_parallel_size=args.tensor_parallel_size,
    )
    prompts = [
        [(7919 * i + 104729 * b) % 100_000 for i in range(args.prompt_len)]
        for b in range(args.batch)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    for _ in range(2):
        llm.generate(prompts, params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / args.output_len
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA" and not getattr(event, "is_user_annotation", False):
            kernels.setdefault(event.name[:70], []).append(event.device_time)
    total = sum(sum(times) for times in kernels.values())
    print(
        f"{args.model} TP={args.tensor_parallel_size} batch {args.batch}: {per_step * 1e6:,.0f} us "
        f"a step; kernels {total / args.output_len:,.0f} us a step (rank 0)"
    )
    nccl = sorted(t for name, times in kernels.items() if "nccl" in name.lower() for t in times)
    if nccl:
        waits = sum(t for t in nccl if t > 40)
        print(
            f"NCCL kernels: {len(nccl)}, median {statistics.median(nccl):.1f} us, "
            f"p99 {nccl[int(len(nccl) * 0.99)]:.1f} us, above 40 us {waits / 1e3:.2f} ms in all"
        )
    print(f"{'ms':>9} {'count':>7} {'median us':>10}  kernel")
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))
    for name, times in ranked[: args.top]:
        print(f"{sum(times) / 1e3:9.2f} {len(times):7d} {statistics.median(times):10.1f}  {name}")
    llm.close()


if __name__ == "__main__":
    main()
