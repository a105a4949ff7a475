"""Sampled decoding against greedy decoding, end to end and for the sampler alone.

    python benchmarks/bench_sampling.py [--model qwen2.5-0.5b] [--batch 256] [--json PATH]

Needs CUDA. End to end: one engine (random weights, bf16, cache on, max batch = ``--batch``) serves
``--batch`` random prompts of ``--input-len`` tokens, ``--output-len`` new tokens each (EOS
ignored), once per sampling configuration: greedy; temperature 0.8 with top-p 0.95, with top-k 50,
with min-p 0.05, with presence and frequency penalties 0.5; plain temperature 1.0. Configurations
run in interleaved rounds (each round in a rotated order, fresh random prompts every run, so nothing
hits the prefix cache), after one short warm-up run each (kernel compilation); reported: the median
output tokens per second (completion tokens over the wall time of the whole batch, prefill included,
as `radixinfer bench` counts it), its ratio to greedy's, and over the configuration's last run
the engine's prefill and decode forwards, preemptions and recomputed rows, and the CUDA caching
allocator's retries, device allocations and frees (each free of a retry waits for the device).

The sampler alone: ``[--batch, 151936]`` bf16 logits (N(0, 2^2)), each configuration through the
sorting-free Triton kernel (`kernels.sampling.sample_triton`, split rows, with the filter flags of
the configuration's batch), its one-program-per-row predecessor (`sample_triton_rowwise`) and its
sorting PyTorch reference on the GPU (`sample_ref`, what the sampler did first: sort, softmax,
cumsum), greedy through the argmax kernel, and the penalties' logits processing
(`LogitsProcessor`, every row penalised, with the step's count update). Times are medians of
`triton.testing.do_bench` (L2 cleared before each call, host launches included). The kernel's
launch settings come from ``RADIXINFER_SAMPLING_TILES`` (`kernels.sampling.Tiles`), for the engine
as for the sampler alone; `sweep_sampling.py` checks the kernel on the GPU and sweeps them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.argmax import argmax_triton  # noqa: E402
from kernels.sampling import TILES, sample_ref, sample_triton, sample_triton_rowwise  # noqa: E402
from radixinfer import LLM, SamplingParams  # noqa: E402
from radixinfer.engine.logits_processing import LogitsProcessor  # noqa: E402
from radixinfer.engine.request import Request  # noqa: E402
from radixinfer.engine.sampler import SamplingBatch  # noqa: E402

# name -> SamplingParams fields (besides max_tokens, ignore_eos, detokenize)
CONFIGS = {
    "greedy": {},
    "T0.8 top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "T0.8 top-k 50": {"temperature": 0.8, "top_k": 50},
    "T0.8 min-p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "T0.8 presence+frequency 0.5": {
        "temperature": 0.8,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
    },
    "T1.0": {"temperature": 1.0},
}
VOCAB = 151936  # qwen2.5's


STEP_COUNTERS = ("prefill_forwards", "decode_forwards", "preemptions", "recomputed_tokens")
# the caching allocator's: a retry frees its cached blocks (cudaFree waits for the device), so a
# configuration whose steps allocate more than the memory plan left free shows it here
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_counts() -> list[int]:
    """`ALLOCATOR_COUNTERS` as they stand (0 for one this torch does not keep)."""
    stats = torch.cuda.memory_stats()
    return [stats.get(name, 0) for name in ALLOCATOR_COUNTERS]


def bench_engine(
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """Output tokens per second of each configuration in each round, end to end, and the engine's
    step counters over each configuration's last run (forwards, preemptions: a configuration that
    runs more steps, or preempts, for the same tokens shows it here rather than in its kernels).
    Rounds are kept apart so that a stall in one (a kernel compiled mid-run) shows as one slow
    round rather than only in the median."""
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.batch,
    )
    vocab = llm.engine.vocab_size
    rng = np.random.default_rng(0)
    gc.set_threshold(50_000)  # as `radixinfer bench` runs (its --gc-threshold)
    counters = llm.engine.counters
    steps: dict[str, dict[str, int]] = {}

    def run(fields: dict, num: int, input_len: int, output_len: int, name: str = "") -> float:
        prompts = [rng.integers(0, vocab, input_len).tolist() for _ in range(num)]
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, detokenize=False, **fields)
        llm.reset_prefix_cache()
        before = [getattr(counters, c) for c in STEP_COUNTERS] + allocator_counts()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        after = [getattr(counters, c) for c in STEP_COUNTERS] + allocator_counts()
        if name:  # a measured run (the warm-ups have none)
            names = STEP_COUNTERS + ALLOCATOR_COUNTERS
            steps[name] = {c: a - b for c, a, b in zip(names, after, before)}
        return sum(len(o.token_ids) for o in outs) / wall

    for fields in CONFIGS.values():  # compile every kernel the configurations use
        run(fields, args.batch, 64, 4)
    names = list(CONFIGS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rates[name].append(
                run(CONFIGS[name], args.batch, args.input_len, args.output_len, name)
            )
    gc.set_threshold(700)
    return rates, steps


def sampler_inputs(fields: dict, rows: int) -> SamplingBatch:
    """The sampler's per-row tensors for ``rows`` rows sampling with ``fields``."""
    params = SamplingParams(**fields)
    return SamplingBatch.build(
        [params.temperature] * rows,
        [params.top_p] * rows,
        [params.top_k] * rows,
        list(range(rows)),
        [0] * rows,
        torch.device("cuda"),
        min_p=[params.min_p] * rows,
    )


def penalised_requests(rows: int, prompt_len: int) -> list[Request]:
    """Running requests with presence and frequency penalties, each with a random prompt."""
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5)
    return [
        Request(
            request_id=str(i),
            prompt_ids=rng.integers(0, VOCAB, prompt_len),
            params=params,
            salt=None,
            seed=i,
            arrival_index=i,
            detokenizer=None,
            arrival_time=0.0,
            seq=object(),  # stands in for its KV: the counts row stays valid
        )
        for i in range(rows)
    ]


def bench_sampler(rows: int) -> dict[str, dict[str, float]]:
    """Milliseconds per call of the fused kernel and of the sorting reference, per configuration."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, VOCAB, device="cuda", generator=gen).mul_(2).to(torch.bfloat16)
    results: dict[str, dict[str, float]] = {}
    for name, fields in CONFIGS.items():
        if not fields:
            results[name] = {"fused_ms": do_bench(lambda: argmax_triton(logits))}
            continue
        b = sampler_inputs(fields, rows)
        t = (b.inv_temperature, b.top_k, b.top_p, b.min_p, b.keys)
        results[name] = {
            "fused_ms": do_bench(lambda t=t, f=b.filters: sample_triton(logits, *t, filters=f)),
            "rowwise_ms": do_bench(
                lambda t=t: sample_triton_rowwise(logits, *t, block=512, num_warps=16)
            ),
            "reference_ms": do_bench(lambda t=t: sample_ref(logits, *t)),
        }
    processor = LogitsProcessor(VOCAB, torch.device("cuda"), rows)
    reqs = penalised_requests(rows, 1024)
    tokens = torch.zeros(rows, dtype=torch.int64, device="cuda")

    def process() -> None:
        pending = processor.process(reqs, logits)  # (in place: the same logits every call)
        processor.record(pending, tokens)

    results["penalties: logits processing"] = {"fused_ms": do_bench(process)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--device", default="cuda", help="the engine's (the sampler runs on CUDA)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="measured runs per configuration")
    parser.add_argument("--skip-engine", action="store_true", help="the sampler alone")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "args": vars(args),
        "sampling_tiles": str(TILES),
    }

    if not args.skip_engine:
        rounds, steps = bench_engine(args)
        gc.collect()  # the engine's pool goes back before the sampler's own runs
        torch.cuda.empty_cache()
        rates = {name: statistics.median(values) for name, values in rounds.items()}
        greedy = rates["greedy"]
        print(f"\n{args.model}, batch {args.batch}, {args.input_len} in / {args.output_len} out")
        columns = STEP_COUNTERS + ALLOCATOR_COUNTERS
        heads = "".join(f" {c.removeprefix('num_').split('_')[0]:>10}" for c in columns)
        print(f"{'configuration':<30} {'out tok/s':>10} {'vs greedy':>10}{heads}  each round")
        for name, rate in rates.items():
            counts = "".join(f" {steps[name][c]:>10}" for c in columns)
            each = " / ".join(f"{r:,.0f}" for r in rounds[name])
            print(f"{name:<30} {rate:>10,.0f} {rate / greedy:>10.3f}{counts}  {each}")
        result["engine"] = {
            name: {
                "out_tok_s": rate,
                "ratio_to_greedy": rate / greedy,
                "rounds_out_tok_s": rounds[name],
                "steps": steps[name],
            }
            for name, rate in rates.items()
        }

    sampler = bench_sampler(args.batch)
    print(f"\nsampler alone, [{args.batch}, {VOCAB}] bf16 logits (ms per call)")
    print(f"tiles {TILES}")
    print(f"{'configuration':<30} {'fused':>8} {'rowwise':>8} {'reference':>10}")
    for name, times in sampler.items():
        row, ref = times.get("rowwise_ms"), times.get("reference_ms")
        row_text = f"{row:>8.3f}" if row is not None else f"{'':>8}"
        ref_text = f"{ref:>10.3f}" if ref is not None else f"{'':>10}"
        print(f"{name:<30} {times['fused_ms']:>8.3f} {row_text} {ref_text}")
    result["sampler"] = sampler

    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
