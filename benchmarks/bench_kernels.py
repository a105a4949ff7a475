"""Micro-benchmarks of the Triton kernels against their floors, against torch SDPA on contiguous KV,
and fused launches against the launches they replace.

    python benchmarks/bench_kernels.py [--only SECTION ...] [--json PATH]

Needs CUDA. All data is random bf16, block_size 16, block tables a random permutation of the pool (as
fragmented as a long-running server's). Every time is the median (`triton.testing.do_bench`) of a CUDA
graph replay divided by the calls captured in it, so host launch cost is left out, as in an engine that
replays graphs; do_bench clears the L2 before each replay and decode rotates over several layers' caches
(distinct memory), so every kernel reads its inputs from HBM.

Floors: decode and copies are bound by bytes (KV read once, outputs written once) over the HBM bandwidth
measured here (the better of a copy and a sum); extend is bound by FLOPs (causal QK^T and PV) over the
measured bf16 matmul rate, and is compared with SDPA's flash kernel on the same problem laid out
contiguously.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.argmax import argmax_triton  # noqa: E402
from kernels.block_copy import copy_blocks_ref, copy_blocks_triton  # noqa: E402
from kernels.paged_attention import (  # noqa: E402
    decode_num_splits,
    extend_attention_triton,
    extend_block_m,
    paged_decode_attention_triton,
    plan_extend_work,
)
from kernels.rotary import Rotary  # noqa: E402
from kernels.store_kv import store_kv_triton  # noqa: E402
from radixinfer.bench.bandwidth import memory_rates  # noqa: E402

DTYPE = torch.bfloat16
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Model:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int


MODELS = [Model("qwen2.5-0.5b", 14, 2, 64, 24), Model("llama-3.1-8b", 32, 8, 128, 32)]


def median_ms(fn, rep_ms: int = 100) -> float:
    return do_bench(fn, warmup=rep_ms // 4, rep=rep_ms, return_mode="median")


def graph_ms(calls: list[Callable[[], object]], rep_ms: int = 100) -> float:
    """Median milliseconds per call of one CUDA graph that replays ``calls`` in order, timed over
    about ``rep_ms`` of replays."""
    for call in calls:  # compile and allocate outside the capture
        call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    return median_ms(graph.replay, rep_ms) / len(calls)


def ceilings() -> dict:
    """HBM bandwidth (the better of a copy, bytes read + written, and a sum, bytes read: the bench's
    own probe, `radixinfer.bench.bandwidth.memory_rates`) and the bf16 matmul rate, measured on
    random data."""
    copy_tbs, read_tbs = (rate / 1e12 for rate in memory_rates(torch.device("cuda")))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=DTYPE) for _ in range(2))
    matmul_tflops = 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9
    return {
        "copy_TBps": copy_tbs,
        "read_TBps": read_tbs,
        "hbm_TBps": max(copy_tbs, read_tbs),
        "matmul_TFLOPs": matmul_tflops,
    }


def paged_pool(num_layers: int, num_seqs: int, context_len: int, m: Model):
    """K and V pools [num_layers, num_blocks, BLOCK_SIZE, Hkv, D] and one random block table for every layer."""
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_layers, num_blocks, BLOCK_SIZE, m.num_kv_heads, m.head_dim)
    k_pool, v_pool = (
        torch.randn(shape, device="cuda", dtype=DTYPE),
        torch.randn(shape, device="cuda", dtype=DTYPE),
    )
    tables = (
        torch.randperm(num_blocks, device="cuda").to(torch.int32).view(num_seqs, blocks_per_seq)
    )
    return k_pool, v_pool, tables


def sdpa_decode_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """One SDPA flash call per layer of ``k``/``v`` (``[num_layers, B, Hkv, C, D]``), with native GQA (each
    KV head read once for its group); where this torch lacks that, over K/V repeated to the query heads."""

    def calls(k, v, **kwargs):
        return [
            lambda i=i: scaled_dot_product_attention(q, k[i], v[i], scale=scale, **kwargs)
            for i in range(len(k))
        ]

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            return graph_ms(calls(k, v, enable_gqa=True)), "flash"
        except RuntimeError:
            group = q.shape[1] // k.shape[2]
            return graph_ms(
                calls(k.repeat_interleave(group, 2), v.repeat_interleave(group, 2))
            ), "flash, repeated KV"


def bench_decode(m: Model, num_seqs: int, context_len: int, hbm_tbs: float) -> dict:
    kv_bytes = 2 * num_seqs * context_len * m.num_kv_heads * m.head_dim * DTYPE.itemsize
    num_layers = max(
        2, min(16, int(4e9 // kv_bytes))
    )  # distinct caches per replay, a few GB at most
    k_pool, v_pool, tables = paged_pool(num_layers, num_seqs, context_len, m)
    q = torch.randn(num_seqs, m.num_heads, m.head_dim, device="cuda", dtype=DTYPE)
    context_lens = torch.full((num_seqs,), context_len, device="cuda", dtype=torch.int32)
    scale = m.head_dim**-0.5
    triton_ms = graph_ms(
        [
            lambda i=i: paged_decode_attention_triton(
                q, k_pool[i], v_pool[i], tables, context_lens, context_len, scale
            )
            for i in range(num_layers)
        ]
    )
    # the baseline: SDPA over the same amount of KV laid out contiguously
    k, v = (
        torch.randn(
            num_layers,
            num_seqs,
            m.num_kv_heads,
            context_len,
            m.head_dim,
            device="cuda",
            dtype=DTYPE,
        )
        for _ in range(2)
    )
    sdpa_ms, sdpa_kind = sdpa_decode_calls(q.unsqueeze(2), k, v, scale)
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + tables.numel() * 4
    floor_us = io_bytes / hbm_tbs / 1e6
    return {
        "model": m.name,
        "batch x context": f"{num_seqs}x{context_len}",
        "splits": decode_num_splits(num_seqs, m.num_kv_heads, context_len, q.device),
        "KV MB": kv_bytes / 1e6,
        "floor us": floor_us,
        "triton us": triton_ms * 1e3,
        "triton TB/s": io_bytes / triton_ms / 1e9,
        "of floor": floor_us / (triton_ms * 1e3),
        "sdpa us": sdpa_ms * 1e3,
        "sdpa TB/s": io_bytes / sdpa_ms / 1e9,
        "sdpa kernel": sdpa_kind,
    }


def bench_extend(
    m: Model, num_seqs: int, new_len: int, prefix_len: int, matmul_tflops: float
) -> dict:
    context_len = prefix_len + new_len
    k_pool, v_pool, tables = paged_pool(1, num_seqs, context_len, m)
    q = torch.randn(num_seqs * new_len, m.num_heads, m.head_dim, device="cuda", dtype=DTYPE)
    context_lens = torch.full((num_seqs,), context_len, device="cuda", dtype=torch.int32)
    query_start_loc = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * new_len
    scale = m.head_dim**-0.5
    block_m = extend_block_m(DTYPE)
    work = np.zeros((2, num_seqs * -(-new_len // block_m)), dtype=np.int32)
    plan_extend_work(np.full(num_seqs, new_len), np.full(num_seqs, context_len), block_m, work)
    work = torch.from_numpy(work).cuda()
    triton_ms = graph_ms(
        [
            lambda: extend_attention_triton(
                q, k_pool[0], v_pool[0], tables, context_lens, query_start_loc, work, scale
            )
        ]
    )

    # SDPA's flash kernel, bottom-right causal (new token i sees the prefix and new tokens 0..i), K/V heads
    # repeated to the query heads as that kernel needs
    q4 = q.view(num_seqs, new_len, m.num_heads, m.head_dim).transpose(1, 2)
    k, v = (
        torch.randn(num_seqs, m.num_heads, context_len, m.head_dim, device="cuda", dtype=DTYPE)
        for _ in range(2)
    )
    sdpa_ms = graph_ms(
        [
            lambda: torch.ops.aten._scaled_dot_product_flash_attention(
                q4, k, v, 0.0, is_causal=True, scale=scale
            )
        ]
    )
    flops = (
        4
        * num_seqs
        * m.num_heads
        * m.head_dim
        * (new_len * prefix_len + new_len * (new_len + 1) / 2)
    )
    return {
        "model": m.name,
        "seqs x new (+prefix)": f"{num_seqs}x{new_len} (+{prefix_len})",
        "floor us": flops / matmul_tflops / 1e6,
        "triton us": triton_ms * 1e3,
        "triton TFLOP/s": flops / triton_ms / 1e9,
        "sdpa us": sdpa_ms * 1e3,
        "sdpa TFLOP/s": flops / sdpa_ms / 1e9,
        "triton / sdpa": sdpa_ms / triton_ms,
    }


def moved_row(kernel: str, m: Model, moved: int, hbm_tbs: float, triton_ms: float) -> dict:
    """The columns every copy-like kernel reports: ``moved`` bytes against the HBM floor."""
    return {
        "kernel": kernel,
        "model": m.name,
        "MB moved": moved / 1e6,
        "floor us": moved / hbm_tbs / 1e6,
        "triton us": triton_ms * 1e3,
        "TB/s": moved / triton_ms / 1e9,
    }


def bench_copy_blocks(m: Model, num_copies: int, hbm_tbs: float) -> dict:
    num_blocks = 4 * num_copies
    shape = (m.num_layers, num_blocks, BLOCK_SIZE, m.num_kv_heads, m.head_dim)
    k_pool, v_pool = (
        torch.randn(shape, device="cuda", dtype=DTYPE),
        torch.randn(shape, device="cuda", dtype=DTYPE),
    )
    perm = torch.randperm(num_blocks, device="cuda")
    src, dst = perm[:num_copies], perm[num_copies : 2 * num_copies]
    moved = (
        2 * 2 * num_copies * k_pool[0, 0].numel() * m.num_layers * DTYPE.itemsize
    )  # read + write, K and V
    triton_ms = graph_ms([lambda: copy_blocks_triton(k_pool, v_pool, src, dst)])
    ref_ms = graph_ms([lambda: copy_blocks_ref(k_pool, v_pool, src, dst)])
    row = moved_row(f"copy_blocks {num_copies} blocks", m, moved, hbm_tbs, triton_ms)
    return row | {"torch ref us": ref_ms * 1e3}


def bench_store_kv(m: Model, num_tokens: int, hbm_tbs: float) -> dict:
    num_blocks = 4 * math.ceil(num_tokens / BLOCK_SIZE)
    k_pool, v_pool, _ = paged_pool(1, 1, num_blocks * BLOCK_SIZE, m)
    k, v = (
        torch.randn(num_tokens, m.num_kv_heads, m.head_dim, device="cuda", dtype=DTYPE)
        for _ in range(2)
    )
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
    moved = 2 * 2 * k.numel() * DTYPE.itemsize + slots.numel() * 8
    triton_ms = graph_ms([lambda: store_kv_triton(k_pool[0], v_pool[0], k, v, slots)])
    row = moved_row(f"store_kv {num_tokens} tokens", m, moved, hbm_tbs, triton_ms)
    # store_kv_ref syncs (boolean indexing): no graph to time it in
    return row | {"torch ref us": None}


def bench_rotary_store_kv(m: Model, num_tokens: int, hbm_tbs: float) -> dict:
    """A decode step's rotary + KV store over every layer: the fused launch per layer
    (`store_kv_triton` given a `Rotary`) against the two it replaces, rotary of q and k in place, then
    the plain store. The rotary launch is the same kernel given q and k as one tensor of
    ``num_heads + num_kv_heads`` heads (adjacent in the qkv projection, as in the models) and only
    slot -1, so it moves what the former rotary kernel moved (plus the slot ids, 8 bytes a token).
    Each layer has its own qkv and cache; the quarter-turn angles (cos, sin in {0, +-1}) keep
    repeated in-place rotations exact."""
    num_blocks = 4 * math.ceil(num_tokens / BLOCK_SIZE)
    k_pool, v_pool, _ = paged_pool(m.num_layers, 1, num_blocks * BLOCK_SIZE, m)
    heads = m.num_heads + 2 * m.num_kv_heads
    qkv = torch.randn(m.num_layers, num_tokens, heads, m.head_dim, device="cuda", dtype=DTYPE)
    q, k, v = qkv.split([m.num_heads, m.num_kv_heads, m.num_kv_heads], dim=2)
    qk = qkv[:, :, : m.num_heads + m.num_kv_heads]
    turns = torch.randint(4, (num_tokens, m.head_dim // 2), device="cuda") * (math.pi / 2)
    cos, sin = turns.cos().round().to(DTYPE), turns.sin().round().to(DTYPE)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
    no_slots = torch.full_like(slots, -1)

    def fused(i):
        store_kv_triton(k_pool[i], v_pool[i], k[i], v[i], slots, Rotary(q[i], cos, sin))

    def separate(i):
        store_kv_triton(k_pool[i], v_pool[i], k[i], v[i], no_slots, Rotary(qk[i], cos, sin))
        store_kv_triton(k_pool[i], v_pool[i], k[i], v[i], slots)

    layers = range(m.num_layers)
    fused_ms = graph_ms([lambda i=i: fused(i) for i in layers])
    separate_ms = graph_ms([lambda i=i: separate(i) for i in layers])
    # q read and written, k and v read and written once (into the cache), cos/sin and the slot ids read
    moved = (
        2 * q[0].numel() + 2 * k[0].numel() + 2 * v[0].numel() + 2 * cos.numel()
    ) * DTYPE.itemsize + slots.numel() * 8
    row = moved_row(f"rotary + store_kv {num_tokens} tokens", m, moved, hbm_tbs, fused_ms)
    return row | {"2 launches us": separate_ms * 1e3, "fused speed-up": separate_ms / fused_ms}


def bench_argmax(rows: int, vocab: int, hbm_tbs: float) -> dict:
    """The greedy sampler's reduction over a decode step's logits (bf16, as the models return them)."""
    logits = torch.randn(rows, vocab, device="cuda", dtype=DTYPE)
    read = logits.numel() * DTYPE.itemsize
    triton_ms = graph_ms([lambda: argmax_triton(logits)])
    torch_ms = graph_ms([lambda: logits.argmax(dim=-1)])
    return {
        "kernel": f"argmax {rows} x {vocab}",
        "MB read": read / 1e6,
        "floor us": read / hbm_tbs / 1e6,
        "triton us": triton_ms * 1e3,
        "TB/s": read / triton_ms / 1e9,
        "torch argmax us": torch_ms * 1e3,
    }


def table(rows: list[dict]) -> str:
    def fmt(x):
        return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)

    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(r[h]) for h in head) + " |" for r in rows]
    return "\n".join(lines)


# section name -> (title, the rows it measures given the ceilings)
SECTIONS: dict[str, tuple[str, Callable[[dict], list[dict]]]] = {
    "decode": (
        "decode attention (bf16, block_size 16; per layer)",
        lambda ceil: [
            bench_decode(m, b, c, ceil["hbm_TBps"])
            for m in MODELS
            for b, c in [(1, 32768), (64, 4096), (256, 1024), (1, 1024)]
        ],
    ),
    "extend": (
        "extend attention (bf16, block_size 16)",
        lambda ceil: [
            bench_extend(m, 8, 2048, p, ceil["matmul_TFLOPs"]) for m in MODELS for p in (0, 1024)
        ],
    ),
    "moves": (
        "KV copies",
        lambda ceil: (
            [bench_copy_blocks(m, 256, ceil["hbm_TBps"]) for m in MODELS]
            + [bench_store_kv(m, n, ceil["hbm_TBps"]) for m in MODELS for n in (256, 16384)]
        ),
    ),
    "rotary_store_kv": (
        "rotary fused into the KV store, per layer (decode: one token a sequence)",
        lambda ceil: [
            bench_rotary_store_kv(m, n, ceil["hbm_TBps"]) for m in MODELS for n in (1, 64, 512)
        ],
    ),
    "argmax": (
        "greedy sampling: argmax over the logits",
        lambda ceil: [
            bench_argmax(r, v, ceil["hbm_TBps"])
            for r, v in [(512, 151936), (64, 151936), (128, 50257)]
        ],
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument(
        "--only", nargs="+", choices=list(SECTIONS), help="run these sections (default: all)"
    )
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    ceil = ceilings()
    print(
        f"# {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 1e6:.0f} MB; "
        f"torch {torch.__version__}; copy {ceil['copy_TBps']:.2f} TB/s (read+write), "
        f"sum {ceil['read_TBps']:.2f} TB/s (read), "
        f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s",
        flush=True,
    )
    results: dict = {"device": props.name, "ceilings": ceil}
    for name in args.only or SECTIONS:
        title, measure = SECTIONS[name]
        results[name] = measure(ceil)
        print(f"\n## {title}\n" + table(results[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
