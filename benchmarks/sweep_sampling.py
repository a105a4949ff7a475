"""The sampling kernel alone on the GPU: exactness against the sorting reference, old (one program
per row) against new (split rows) per configuration against the memory floor, and a sweep of the
new kernel's launch settings (`kernels.sampling.Tiles`). About 1-2 minutes on an H100.

    python benchmarks/sweep_sampling.py [--json PATH] [--quick]

Needs CUDA. Shapes: ``[256, 151936]`` (qwen2.5) and ``[64, 128256]`` (llama-3.1) bf16 logits,
N(0, 2^2). Configurations as `bench_sampling.py` runs them end to end: greedy (the argmax kernel),
temperature 0.8 with top-p 0.95, top-k 50, min-p 0.05, all three, and temperature 1.0 alone; each
call gets the filter flags its batch would (`SamplingBatch.filters`).

1. ``check``: tokens of the new kernel (default settings; the other choice of each of
   ``histogram`` (with 4-bit counts), ``exact_bits`` (8 or 0), ``digit_bits``, ``buckets_first``;
   every pass launched whatever the filters) and
   of the old one against `sample_ref` on 256 rows mixing greedy rows, each filter alone and
   combined, with fresh keys per row; also each configuration's rows.
   Top-p masses are float sums in another order, so a boundary token may flip on a rare row: up to
   2 mismatches per 256 rows pass, more fail (the script still goes on, exit status 1 at the end).
2. ``time``: per shape and configuration, microseconds per call (median; one CUDA graph replay per
   call, so launch gaps are left out; ``eager`` is `triton.testing.do_bench` without a graph, L2
   cleared, host launches included) of the new kernel, the old one (block 512, 16 warps: its best)
   and greedy's argmax; ``floor`` is one read of the logits at the measured HBM bandwidth
   (`bench_kernels.ceilings`: the better of a copy and a sum); ``x floor`` the new kernel's ratio.
3. ``sweep`` (at ``[256, 151936]``): on top-p the bucket sums' layout (``buckets_first``), the
   digit width (``digit_bits`` 4 or 2), the digit passes' ``search_block`` x ``search_warps``,
   ``programs_per_sm`` (chunks per row), ``unroll`` (blocks a mass pass reads an iteration),
   ``exact_bits`` (the mass search's counted last bits: 8, 4, or 0 for none); the streaming
   passes' ``block`` x ``warps`` on min-p; on top-k ``count_bits`` (key bits a count pass finds),
   ``histogram`` (at 4 bits), the count passes' ``count_block``, and ``block`` x ``warps`` again
   (the draw skips blocks keeping no token: smaller blocks skip more); one axis at a time from the
   defaults, each axis's best kept; then
   every configuration again with the best settings. The last line prints them as the value of
   ``RADIXINFER_SAMPLING_TILES``, which the engine reads at import (`bench_sampling.py` end to end
   takes them the same way).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import ceilings, graph_ms, table  # noqa: E402

from kernels.argmax import argmax_triton  # noqa: E402
from kernels.sampling import (  # noqa: E402
    TILES,
    Tiles,
    sample_ref,
    sample_triton,
    sample_triton_rowwise,
)
from radixinfer.engine.sampler import SamplingBatch  # noqa: E402

DEVICE = torch.device("cuda")
SHAPES = [(256, 151936), (64, 128256)]
CONFIGS = {
    "greedy": {},
    "T0.8 top-p 0.95": {"top_p": 0.95},
    "T0.8 top-k 50": {"top_k": 50},
    "T0.8 min-p 0.05": {"min_p": 0.05},
    "T0.8 all three": {"top_p": 0.95, "top_k": 50, "min_p": 0.05},
    "T1.0": {"temperature": 1.0},
}
ALLOWED_MISMATCHES = 2  # per 256 rows: top-p boundary tokens under float rounding


def batch_for(rows: int, fields: dict, seed: int = 0) -> SamplingBatch:
    """The sampler's per-row tensors and filter flags for ``rows`` rows sampling with ``fields``."""
    return SamplingBatch.build(
        [fields.get("temperature", 0.8)] * rows,
        [fields.get("top_p", 1.0)] * rows,
        [fields.get("top_k", 0)] * rows,
        [seed * rows + i for i in range(rows)],
        [0] * rows,
        DEVICE,
        min_p=[fields.get("min_p", 0.0)] * rows,
    )


def mixed_batch(rows: int, seed: int) -> SamplingBatch:
    """Greedy rows, each filter alone and combined, random parameters."""
    gen = torch.Generator().manual_seed(seed)
    temperature = (torch.rand(rows, generator=gen) * 1.5 + 0.1).tolist()
    top_k = torch.randint(1, 200, (rows,), generator=gen).tolist()
    top_p = (torch.rand(rows, generator=gen) * 0.99).tolist()
    min_p = (torch.rand(rows, generator=gen) * 0.2).tolist()
    for i in range(rows):
        mode = i % 8  # 0 greedy, 1 T only, 2 top-k, 3 top-p, 4 min-p, 5-7 combinations
        temperature[i] = 0.0 if mode == 0 else temperature[i]
        top_k[i] = top_k[i] if mode in (2, 5, 7) else 0
        top_p[i] = top_p[i] if mode in (3, 5, 6) else 1.0
        min_p[i] = min_p[i] if mode in (4, 6, 7) else 0.0
    return SamplingBatch.build(
        temperature, top_p, top_k, list(range(seed, seed + rows)), [seed] * rows, DEVICE,
        min_p=min_p,
    )  # fmt: skip


def tensors(batch: SamplingBatch) -> tuple[torch.Tensor, ...]:
    return batch.inv_temperature, batch.top_k, batch.top_p, batch.min_p, batch.keys


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(rows, vocab, device=DEVICE, generator=gen).mul_(2).to(torch.bfloat16)


def check() -> tuple[list[dict], bool]:
    """Mismatches against `sample_ref` per kernel and batch; whether all are within the bound."""
    results, ok = [], True
    other = dataclasses.replace(
        TILES,
        histogram=not TILES.histogram,
        count_bits=4 if TILES.histogram else 8,
        exact_bits=0 if TILES.exact_bits else 8,
        digit_bits=6 - TILES.digit_bits,
        buckets_first=not TILES.buckets_first,
    )
    kernels = {
        "new": lambda x, b: sample_triton(x, *tensors(b), filters=b.filters),
        "new, other tiles": lambda x, b: sample_triton(
            x, *tensors(b), filters=b.filters, tiles=other
        ),
        "new, all passes": lambda x, b: sample_triton(x, *tensors(b)),
        "old": lambda x, b: sample_triton_rowwise(x, *tensors(b), block=512, num_warps=16),
    }
    for rows, vocab in SHAPES:
        batches = {f"mixed {s}": mixed_batch(rows, s) for s in range(3)}
        batches |= {name: batch_for(rows, f) for name, f in CONFIGS.items() if f}
        for i, (batch_name, batch) in enumerate(batches.items()):
            logits = random_logits(rows, vocab, seed=100 + i)
            ref = sample_ref(logits, *tensors(batch))
            row = {"shape": f"{rows} x {vocab}", "batch": batch_name}
            for name, fn in kernels.items():
                bad = int((fn(logits, batch) != ref).sum())
                row[name] = bad
                ok &= bad <= ALLOWED_MISMATCHES * max(1, rows // 256)
            results.append(row)
    return results, ok


def time_configs(tiles: Tiles, hbm_tbs: float, old: bool = True) -> list[dict]:
    """Microseconds per call of every configuration at every shape."""
    results = []
    for rows, vocab in SHAPES:
        logits = random_logits(rows, vocab)
        floor_us = logits.numel() * logits.element_size() / hbm_tbs / 1e6
        greedy_us = graph_ms([lambda x=logits: argmax_triton(x)]) * 1e3
        for name, fields in CONFIGS.items():
            row = {"shape": f"{rows} x {vocab}", "config": name, "floor us": floor_us}
            row |= {"new us": greedy_us, "x floor": greedy_us / floor_us, "over greedy us": 0.0}
            row |= {"new eager us": None} | ({"old us": None} if old else {})
            if not fields:
                results.append(row)
                continue
            batch = batch_for(rows, fields)
            t = tensors(batch)

            def new(x=logits, t=t, f=batch.filters):
                return sample_triton(x, *t, filters=f, tiles=tiles)

            row["new us"] = graph_ms([new]) * 1e3
            row["x floor"] = row["new us"] / floor_us
            row["over greedy us"] = row["new us"] - greedy_us
            row["new eager us"] = do_bench(new, rep=50, return_mode="median") * 1e3
            if old:
                row["old us"] = (
                    graph_ms(
                        [
                            lambda x=logits, t=t: sample_triton_rowwise(
                                x, *t, block=512, num_warps=16
                            )
                        ]
                    )
                    * 1e3
                )
            results.append(row)
    return results


def sweep_ms(tiles: Tiles, rows: int, vocab: int, fields: dict) -> float | None:
    """Milliseconds per call (graph replay) of one configuration, None when it fails to build."""
    logits = random_logits(rows, vocab)
    batch = batch_for(rows, fields)
    try:
        return graph_ms([lambda: sample_triton(logits, *tensors(batch), batch.filters, tiles)])
    except Exception as exc:  # a setting that does not compile (registers, shared memory)
        print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def sweep(quick: bool) -> tuple[Tiles, list[dict]]:
    """One axis at a time from the defaults, keeping each axis's best."""
    rows, vocab = SHAPES[0]
    axes = [
        ("T0.8 top-p 0.95", [{"buckets_first": f} for f in (True, False)]),
        ("T0.8 top-p 0.95", [{"digit_bits": d} for d in (4, 2)]),
        ("T0.8 top-p 0.95", [
            {"search_block": b, "search_warps": w}
            for b, w in ((512, 8), (256, 4), (256, 8), (512, 4), (512, 16), (1024, 8), (1024, 16))
        ]),
        ("T0.8 top-p 0.95", [{"programs_per_sm": p} for p in (16, 8, 32, 64)]),
        ("T0.8 top-p 0.95", [{"unroll": u} for u in (1, 2, 4)]),
        ("T0.8 top-p 0.95", [{"exact_bits": e} for e in (8, 4, 0)]),
        ("T0.8 min-p 0.05", [
            {"block": b, "warps": w} for b, w in ((2048, 8), (1024, 4), (2048, 4), (4096, 8))
        ]),
        ("T0.8 top-k 50", [{"count_bits": c} for c in (8, 4, 6)]),
        ("T0.8 top-k 50", [{"histogram": h, "count_bits": 4} for h in (True, False)]),
        ("T0.8 top-k 50", [{"count_block": b} for b in (2048, 256, 1024, 4096)]),
        ("T0.8 top-k 50", [
            {"block": b, "warps": w} for b, w in ((2048, 8), (512, 4), (1024, 8), (256, 4))
        ]),
    ]  # fmt: skip
    if quick:
        axes = [(name, options[:2]) for name, options in axes]
    print("\n## sweep at 256 x 151936", flush=True)
    best, results = TILES, []
    for config, options in axes:
        timed = []
        for option in options:
            tiles = dataclasses.replace(best, **option)
            done = [r["us"] for r in results if r["config"] == config and r["tiles"] == str(tiles)]
            if done:  # the axis's starting point, timed on the previous axis
                if done[0] is not None:
                    timed.append((done[0] / 1e3, tiles))
                continue
            ms = sweep_ms(tiles, rows, vocab, CONFIGS[config])
            print(
                f"  {config:<16} {tiles}: {'failed' if ms is None else f'{ms * 1e3:.1f} us'}",
                flush=True,
            )
            results.append({"config": config, "tiles": str(tiles), "us": ms and ms * 1e3})
            if ms is not None:
                timed.append((ms, tiles))
        if timed:
            best = min(timed, key=lambda t: t[0])[1]
    return best, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--quick", action="store_true", help="two settings per sweep axis")
    args = parser.parse_args()
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "tiles": str(TILES)}

    checked, ok = check()
    print(f"## check: mismatches against sample_ref (pass: <= {ALLOWED_MISMATCHES} per 256 rows)")
    print(table(checked) + ("\nall within bound" if ok else "\nMISMATCHES ABOVE BOUND"), flush=True)
    out["check"], out["check_ok"] = checked, ok

    ceiling = ceilings()
    hbm = ceiling["hbm_TBps"]
    print(
        f"\nHBM {hbm:.2f} TB/s (copy {ceiling['copy_TBps']:.2f}, read {ceiling['read_TBps']:.2f})"
    )
    out["ceilings"] = ceiling
    timed = time_configs(TILES, hbm)
    print(f"\n## time, default tiles {TILES}\n" + table(timed), flush=True)
    out["time"] = timed

    best, swept = sweep(args.quick)
    print("\n## sweep at 256 x 151936, us per call\n" + table(swept))
    out["sweep"] = swept
    retimed = time_configs(best, hbm, old=False)
    print(f"\n## time, best tiles {best}\n" + table(retimed))
    out["time_best"], out["best_tiles"] = retimed, str(best)
    print(f"\nRADIXINFER_SAMPLING_TILES={best}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
