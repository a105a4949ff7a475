"""The skinny GEMM (`kernels/skinny_gemm.py`) against cuBLAS (``F.linear``) at decode batch sizes.

    python benchmarks/bench_skinny_gemm.py [--json PATH] [--tokens 1 8 32 64] [--models ...] [--no-sweep]
    python benchmarks/bench_skinny_gemm.py --list     # the cases and configs, no GPU needed

Needs CUDA (but ``--list``). Shapes are the real per-rank shapes of the models' four matmuls at tensor
parallelism 1 and 2 (column-parallel qkv and gate_up halve N, row-parallel o_proj and down_proj halve K),
bf16, without bias (qwen2.5's qkv bias is a few KB). For each shape and token count it times:

- ``cublas``: ``F.linear``;
- ``rule``: the Triton kernel with `skinny_config`'s launch shape (what the engine runs);
- every config of a small sweep around it, and prints the best (``best``, ``best config`` as
  block_m/block_n/block_k/warps/stages);
- for gate_up, also ``F.linear`` + ``silu_and_mul_triton`` (two launches, today's MLP) against the fused
  kernel at the rule's launch shape (``fused``).

Each time is one CUDA graph of back-to-back calls, each on a different copy of the weight (enough copies
to pass 3x the L2, so every call reads its weight from HBM, as a decode step reading every layer once does),
divided by the calls; the median of `triton.testing.do_bench`'s replays. ``floor``: the weight's bytes over
the HBM bandwidth measured here (`bench_kernels.ceilings`); ``of HBM``: floor over time. The last table adds
each (model, TP, tokens)'s four matmuls over all layers: a decode step's linear layers, cuBLAS against the
rule (the fused gate_up counted for the rule).

Not yet run on a GPU when written: estimated at 1-2 minutes on an H200, mostly compiling ~80 kernel variants
(one per launch shape and K class) and ~500 graphs; ``--no-sweep`` times only the rule's launch shape.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import ceilings, graph_ms, table  # noqa: E402  (this script's folder)

from kernels.activation import silu_and_mul_triton  # noqa: E402
from kernels.device import num_sms  # noqa: E402
from kernels.skinny_gemm import (  # noqa: E402
    REDUCE_PRODUCTS,
    GemmConfig,
    linear_silu_and_mul_triton,
    linear_triton,
    skinny_config,
)
from radixinfer.distributed.group import TensorParallel  # noqa: E402
from radixinfer.models.parallel import AttentionShards, OutputShard  # noqa: E402
from radixinfer.models.presets import preset_config  # noqa: E402

DTYPE = torch.bfloat16
MODELS = ["qwen2.5-0.5b", "llama-3.1-8b"]


@dataclass(frozen=True)
class Shape:
    """One matmul of a model's layer on one rank: ``[M, k] @ [n, k]^T``, ``layers`` times per step."""

    model: str
    tp: int
    layer: str
    n: int
    k: int
    layers: int

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * DTYPE.itemsize


def model_shapes(name: str, tp_size: int) -> list[Shape]:
    """qkv, o_proj, gate_up and down_proj of rank 0 at ``tp_size``, as `radixinfer.models.llama` shards them."""
    config = preset_config(name)
    tp = TensorParallel(0, tp_size)  # a rank that only sizes its shards
    attn = AttentionShards.of(config, tp)
    inter = OutputShard.split(config.intermediate_size, tp, "intermediate_size").local_size
    hidden, layers = config.hidden_size, config.num_hidden_layers
    sizes = {
        "qkv": (attn.q.local_size + 2 * attn.kv.local_size, hidden),
        "o_proj": (hidden, attn.q.local_size),
        "gate_up": (2 * inter, hidden),
        "down_proj": (hidden, inter),
    }
    return [Shape(name, tp_size, layer, n, k, layers) for layer, (n, k) in sizes.items()]


def sweep_configs(m: int, n: int, k: int, sms: int) -> list[GemmConfig]:
    """The rule's config and its neighbours: up to 4 tokens, CUDA-core tiles of 4, 8 or 16 columns, each
    with the most K that `REDUCE_PRODUCTS` allows, on 8 warps, the rule's on 4 warps, and one tl.dot tile
    (padded to 16 tokens); beyond, tl.dot tiles of 16 to 64 columns and 64 or 128 of K on the rule's
    warps, four stages, and the rule's with three."""
    rule = skinny_config(m, n, k, sms)
    bm = rule.block_m
    if m <= 4:
        most_k = triton.next_power_of_2(k)
        configs = {
            GemmConfig(bm, bn, min(4096, most_k, REDUCE_PRODUCTS // (bm * bn)), 8, 1)
            for bn in (4, 8, 16)
        }
        configs |= {rule._replace(num_warps=4), GemmConfig(16, 16, 128, 4, 4)}
    else:
        configs = {rule._replace(block_n=bn, block_k=bk) for bn in (16, 32, 64) for bk in (64, 128)}
        configs.add(rule._replace(num_stages=3))
    return sorted(configs | {rule})


def weight_copies(shape: Shape, rows: int, l2_bytes: int) -> list[torch.Tensor]:
    """Enough random ``[rows, k]`` weights that cycling through them passes 3x the L2 (at least 2)."""
    count = max(2, math.ceil(3 * l2_bytes / (rows * shape.k * DTYPE.itemsize)))
    return [
        torch.randn(rows, shape.k, device="cuda", dtype=DTYPE) * shape.k**-0.5 for _ in range(count)
    ]


def graph_us(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Median microseconds per call of ``fn(x, w)`` over ``weights``, replayed as one CUDA graph."""
    return graph_ms([lambda w=w: fn(x, w) for w in weights], rep_ms=20) * 1e3


def cfg_name(c: GemmConfig) -> str:
    return "/".join(str(v) for v in c)


def bench_shape(
    shape: Shape, tokens: list[int], hbm_tbs: float, l2_bytes: int, sms: int, sweep: bool
) -> list[dict]:
    weights = weight_copies(shape, shape.n, l2_bytes)
    floor_us = shape.weight_bytes / hbm_tbs / 1e6
    rows = []
    for m in tokens:
        x = torch.randn(m, shape.k, device="cuda", dtype=DTYPE)
        cublas = graph_us(F.linear, x, weights)
        rule_cfg = skinny_config(m, shape.n, shape.k, sms)
        configs = sweep_configs(m, shape.n, shape.k, sms) if sweep else [rule_cfg]
        times = {
            c: graph_us(lambda x, w, c=c: linear_triton(x, w, config=c), x, weights)
            for c in configs
        }
        best = min(times, key=times.get)
        row = {
            "model": shape.model, "tp": shape.tp, "layer": shape.layer, "N": shape.n, "K": shape.k,
            "M": m, "weight MB": shape.weight_bytes / 1e6, "floor us": floor_us,
            "cublas us": cublas, "rule us": times[rule_cfg], "best us": times[best],
            "cublas of HBM": floor_us / cublas, "rule of HBM": floor_us / times[rule_cfg],
            "best of HBM": floor_us / times[best], "rule GB/s": shape.weight_bytes / times[rule_cfg] / 1e3,
            "rule config": cfg_name(rule_cfg), "best config": cfg_name(best), "layers": shape.layers,
        }  # fmt: skip
        if shape.layer == "gate_up":
            row["linear+silu us"] = graph_us(
                lambda x, w: silu_and_mul_triton(F.linear(x, w)), x, weights
            )
            row["fused us"] = graph_us(linear_silu_and_mul_triton, x, weights)
        rows.append(row)
        print(
            f"  {shape.model} tp{shape.tp} {shape.layer} M={m}: done", file=sys.stderr, flush=True
        )
    del weights
    torch.cuda.empty_cache()
    return rows


def step_totals(rows: list[dict]) -> list[dict]:
    """Per (model, tp, M): the four matmuls of every layer, cuBLAS (gate_up then silu_and_mul) against the
    rule (the fused gate_up)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["tp"], r["M"])
        layers = r["layers"]
        t = out.setdefault(
            key,
            {
                "model": key[0],
                "tp": key[1],
                "M": key[2],
                "floor us": 0.0,
                "cublas us": 0.0,
                "rule us": 0.0,
            },
        )
        fused = r["layer"] == "gate_up"
        t["floor us"] += layers * r["floor us"]
        t["cublas us"] += layers * (r["linear+silu us"] if fused else r["cublas us"])
        t["rule us"] += layers * (r["fused us"] if fused else r["rule us"])
    for t in out.values():
        t["speedup"] = t["cublas us"] / t["rule us"]
    return list(out.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--list", action="store_true", help="print the cases and configs and exit")
    parser.add_argument(
        "--no-sweep",
        action="store_true",
        help="time only the rule's launch shape (about half the time)",
    )
    args = parser.parse_args()
    shapes = [s for name in args.models for tp in args.tp for s in model_shapes(name, tp)]
    if args.list:
        for s in shapes:
            for m in args.tokens:
                configs = sweep_configs(m, s.n, s.k, 132)
                print(f"{s.model} tp{s.tp} {s.layer} N={s.n} K={s.k} M={m}: rule "
                      f"{cfg_name(skinny_config(m, s.n, s.k, 132))} (132 SMs), {len(configs)} configs")  # fmt: skip
        return

    props = torch.cuda.get_device_properties(0)
    ceil = ceilings()
    sms = num_sms(torch.device("cuda"))
    print(
        f"# {props.name}, {sms} SMs, L2 {props.L2_cache_size / 1e6:.0f} MB; torch {torch.__version__}; "
        f"HBM {ceil['hbm_TBps']:.2f} TB/s (better of copy and sum)",
        flush=True,
    )
    rows = [
        r
        for s in shapes
        for r in bench_shape(
            s, args.tokens, ceil["hbm_TBps"], props.L2_cache_size, sms, not args.no_sweep
        )
    ]
    linear_cols = [
        "model", "tp", "layer", "N", "K", "M", "weight MB", "floor us", "cublas us", "rule us", "best us",
        "cublas of HBM", "rule of HBM", "best of HBM", "rule GB/s", "rule config", "best config",
    ]  # fmt: skip
    print("\n## per matmul (bf16; config: block_m/block_n/block_k/warps/stages)\n")
    print(table([{c: r[c] for c in linear_cols} for r in rows]))
    fused_cols = [
        "model",
        "tp",
        "N",
        "K",
        "M",
        "floor us",
        "cublas us",
        "rule us",
        "linear+silu us",
        "fused us",
    ]
    print(
        "\n## gate_up + SiLU-and-mul: two launches (cuBLAS, then silu_and_mul_triton) against the fused"
        " kernel; cublas and rule: the projection alone\n"
    )
    print(table([{c: r[c] for c in fused_cols} for r in rows if r["layer"] == "gate_up"]))
    totals = step_totals(rows)
    print("\n## a decode step's linear layers (every layer's four matmuls; lm head not included)\n")
    print(table(totals))
    if args.json:
        payload = {"device": props.name, "ceilings": ceil, "shapes": [asdict(s) for s in shapes]}
        args.json.write_text(json.dumps({**payload, "matmuls": rows, "steps": totals}, indent=1))


if __name__ == "__main__":
    main()
