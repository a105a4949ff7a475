"""The skinny GEMM (`kernels/skinny_gemm.py`) against cuBLAS (``F.linear``) at 1-4 tokens.

    python benchmarks/bench_skinny_gemm.py [--json PATH] [--tokens 1 2 4] [--models ...] [--sweep]
    python benchmarks/bench_skinny_gemm.py --list     # the cases, configs and the rule's choice, no GPU

Needs CUDA (but ``--list``). Shapes are the real per-rank shapes of the models' four matmuls and their
output projection (``lm_head``, one a step) at tensor parallelism 1 and 2 (column-parallel qkv, gate_up and
the vocabulary-parallel lm_head halve N, row-parallel o_proj and down_proj halve K), bf16, without bias
(qwen2.5's qkv bias is a few KB). For each shape and token count it times:

- ``cublas``: ``F.linear``;
- ``skinny``: the Triton kernel with `skinny_config`'s launch shape (block_m/block_n/block_k/warps);
- ``--sweep``: also weight tiles of 1 to 16 columns by 512 to 4,096 of K at the first token count, and
  the 8 fastest of those at the others, and prints the best (``best``, ``best config``; the JSON has
  every time).

``rule``: which of the two the engine's layers run there (`radixinfer.models.layers.skinny_gemm_suits`:
at most 2 tokens, on at most 64 MiB of weight, or 128 MiB whose rows fit one weight tile;
``RADIXINFER_SKINNY_GEMM=0`` makes it cuBLAS everywhere).
The engine computes the output projection with ``torch.mm`` (cuBLAS) whatever the rule says: its row is
for comparison.

Each time is one CUDA graph of back-to-back calls, each on a different copy of the weight (enough copies
to pass 3x the L2, so every call reads its weight from HBM, as a decode step reading every layer once does),
divided by the calls; the median of `triton.testing.do_bench`'s replays. ``floor``: the weight's bytes over
the HBM bandwidth measured here (`bench_kernels.ceilings`). The last table adds each (model, TP, tokens)'s
four matmuls over all layers: a decode step's linear layers, all on cuBLAS against what the rule runs
(``engine``: the skinny GEMM where the rule says, cuBLAS elsewhere).
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

from kernels.device import num_sms  # noqa: E402
from kernels.skinny_gemm import GemmConfig, linear_triton, skinny_config  # noqa: E402
from radixinfer.distributed.group import TensorParallel  # noqa: E402
from radixinfer.models import layers  # noqa: E402
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
    hidden, num_layers = config.hidden_size, config.num_hidden_layers
    sizes = {
        "qkv": (attn.q.local_size + 2 * attn.kv.local_size, hidden),
        "o_proj": (hidden, attn.q.local_size),
        "gate_up": (2 * inter, hidden),
        "down_proj": (hidden, inter),
    }
    shapes = [Shape(name, tp_size, layer, n, k, num_layers) for layer, (n, k) in sizes.items()]
    vocab_rows = -(-config.vocab_size // tp_size)
    return shapes + [Shape(name, tp_size, "lm_head", vocab_rows, hidden, 1)]


def rule_runs_skinny(shape: Shape, m: int) -> bool:
    """What the engine's layers run for this matmul (a bf16 batch on CUDA)."""
    return (
        shape.layer != "lm_head"
        and layers.SKINNY_GEMM
        and layers.skinny_gemm_suits(m, shape.k, shape.weight_bytes)
    )


def sweep_configs(m: int, k: int) -> list[GemmConfig]:
    """Launch shapes around the rule's: weight tiles of 1 to 16 columns by 512 to 4,096 of K, 4,096 to
    16,384 weights (4 warps up to 8,192, 8 above)."""
    bm = triton.next_power_of_2(m)
    top_k = max(16, triton.next_power_of_2(k))
    return sorted(
        GemmConfig(bm, bn, bk, 4 if bn * bk <= 8192 else 8)
        for bn in (1, 2, 4, 8, 16)
        for bk in (512, 1024, 2048, 4096)
        if bk <= top_k and 4096 <= bn * bk <= 16384
    )


def weight_copies(shape: Shape, l2_bytes: int) -> list[torch.Tensor]:
    """Enough random ``[n, k]`` weights that cycling through them passes 3x the L2 (at least 2)."""
    count = max(2, math.ceil(3 * l2_bytes / shape.weight_bytes))
    return [
        torch.randn(shape.n, shape.k, device="cuda", dtype=DTYPE) * shape.k**-0.5
        for _ in range(count)
    ]


def graph_us(fn, x: torch.Tensor, weights: list[torch.Tensor], rep_ms: int = 20) -> float:
    """Median microseconds per call of ``fn(x, w)`` over ``weights``, replayed as one CUDA graph."""
    return graph_ms([lambda w=w: fn(x, w) for w in weights], rep_ms=rep_ms) * 1e3


def skinny_us(
    x: torch.Tensor, weights: list[torch.Tensor], config: GemmConfig, rep_ms: int
) -> float:
    """`graph_us` of the skinny GEMM at ``config``."""
    return graph_us(lambda x, w: linear_triton(x, w, config=config), x, weights, rep_ms)


def cfg_name(c: GemmConfig) -> str:
    return "/".join(str(v) for v in c)


def bench_shape(
    shape: Shape, tokens: list[int], hbm_tbs: float, l2_bytes: int, sms: int, sweep: bool
) -> list[dict]:
    weights = weight_copies(shape, l2_bytes)
    floor_us = shape.weight_bytes / hbm_tbs / 1e6
    rows = []
    fastest: list[GemmConfig] = []  # the first token count's launch shapes, fastest first
    for m in tokens:
        x = torch.randn(m, shape.k, device="cuda", dtype=DTYPE)
        cublas = graph_us(F.linear, x, weights)
        config = skinny_config(m, shape.n, shape.k, sms)
        if sweep and not fastest:
            configs = sorted(set(sweep_configs(m, shape.k)) | {config})
        elif sweep:  # the first token count's fastest 8, at this block_m
            bm = triton.next_power_of_2(m)
            configs = sorted({c._replace(block_m=bm) for c in fastest[:8]} | {config})
        else:
            configs = [config]
        times = {c: skinny_us(x, weights, c, 10 if sweep else 20) for c in configs}
        ranked = sorted(times, key=times.get)  # fastest first
        fastest = fastest or ranked
        skinny = times[config]
        row = {
            "model": shape.model, "tp": shape.tp, "layer": shape.layer, "N": shape.n, "K": shape.k,
            "M": m, "weight MB": shape.weight_bytes / 1e6, "floor us": floor_us, "cublas us": cublas,
            "skinny us": skinny, "cublas/skinny": cublas / skinny, "config": cfg_name(config),
            "rule": "skinny" if rule_runs_skinny(shape, m) else "cublas", "layers": shape.layers,
        }  # fmt: skip
        if sweep:
            row |= {"best us": times[ranked[0]], "best config": cfg_name(ranked[0])}
            row["all"] = {cfg_name(c): times[c] for c in ranked}
        rows.append(row)
    print(f"  {shape.model} tp{shape.tp} {shape.layer}: done", file=sys.stderr, flush=True)
    del weights
    torch.cuda.empty_cache()
    return rows


def step_totals(rows: list[dict]) -> list[dict]:
    """Per (model, tp, M): the four matmuls of every layer and the output projection (cuBLAS in both), all on
    cuBLAS against what the rule runs."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["tp"], r["M"])
        zero = {"floor us": 0.0, "cublas us": 0.0, "engine us": 0.0}
        t = out.setdefault(key, {"model": key[0], "tp": key[1], "M": key[2], **zero})
        t["floor us"] += r["layers"] * r["floor us"]
        t["cublas us"] += r["layers"] * r["cublas us"]
        t["engine us"] += r["layers"] * r[f"{r['rule']} us"]
    for t in out.values():
        t["saved us"] = t["cublas us"] - t["engine us"]
        t["speedup"] = t["cublas us"] / t["engine us"]
    return list(out.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--list", action="store_true", help="print the cases and configs and exit")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time the rule's neighbours at the first token count, and the 8 fastest at the others",
    )
    args = parser.parse_args()
    shapes = [s for name in args.models for tp in args.tp for s in model_shapes(name, tp)]
    if args.list:
        for s in shapes:
            for m in args.tokens:
                rule = "skinny" if rule_runs_skinny(s, m) else "cublas"
                print(f"{s.model} tp{s.tp} {s.layer} N={s.n} K={s.k} M={m}: rule {rule}, config "
                      f"{cfg_name(skinny_config(m, s.n, s.k, 132))} (132 SMs)")  # fmt: skip
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
        for r in bench_shape(s, args.tokens, ceil["hbm_TBps"], props.L2_cache_size, sms, args.sweep)
    ]
    print("\n## per matmul (bf16; config: block_m/block_n/block_k/warps)\n")
    print(table([{c: v for c, v in r.items() if c not in ("layers", "all")} for r in rows]))
    totals = step_totals(rows)
    print(
        "\n## a decode step's linear layers (every layer's four matmuls and the lm head, cuBLAS in both):"
        " all cuBLAS against the rule's choice per matmul\n"
    )
    print(table(totals))
    if args.json:
        payload = {"device": props.name, "ceilings": ceil, "shapes": [asdict(s) for s in shapes]}
        args.json.write_text(json.dumps({**payload, "matmuls": rows, "steps": totals}, indent=1))


if __name__ == "__main__":
    main()
