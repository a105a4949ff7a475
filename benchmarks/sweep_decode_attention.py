"""Decode attention at the shared-prefix benchmark's shape, per launch shape of the decode kernel.

    PYTHONPATH=. python benchmarks/sweep_decode_attention.py [--batch 512 --context 1216 --shared 1024 --groups 16]

qwen2.5-0.5b's attention (14 heads, 2 KV heads, head_dim 64, bf16; ``--model llama-3.1-8b``: 32, 8,
128), block_size 16, each group's sequences sharing the blocks of their first ``--shared`` positions and
laid out consecutively (as the engine admits them), every layer's KV distinct. For each (BLOCK_N,
num_warps, num_stages) of the decode kernel it captures a step's `paged_decode_attention_triton` calls
(one a layer) in one CUDA graph and prints the median replay time, once with the shared-prefix tiles the
engine's planner lays out and once reading every sequence's whole context (what the same step costs with
the prefix cache off). The launch shape is swapped by overriding `_decode_config`, the
kernel's one source of it.

With ``--shared-tiles`` it sweeps the shared-prefix tile kernel instead, the decode kernel at its default:
for each (BLOCK_M, BLOCK_N, num_warps, num_stages, chunks per prefix) it overrides `_shared_prefix_config`,
plans the tiles again (a tile holds ``BLOCK_M // group`` sequences) and prints the shared-prefix replay with
that many chunks, and the default shape with the chunks `shared_prefix_chunks` picks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_forward import block_tables  # noqa: E402

import kernels.paged_attention as pa  # noqa: E402
from kernels.device import num_sms  # noqa: E402
from radixinfer.attention.shared_prefix import SharedPrefixPlanner  # noqa: E402

BLOCK_SIZE = 16
# attention shapes: (query heads, KV heads, head_dim, layers)
MODELS = {"qwen2.5-0.5b": (14, 2, 64, 24), "llama-3.1-8b": (32, 8, 128, 32)}
SHAPES = [
    (128, 4, 3),
    (128, 2, 3),
    (64, 4, 3),
    (64, 2, 3),
    (64, 2, 2),
]  # (BLOCK_N, num_warps, num_stages)
TILE_SHAPES = [(64, 64, 4, 2, chunks) for chunks in (1, 2, 4)] + [
    (128, 64, 8, 2, chunks) for chunks in (1, 2, 4)
]  # (BLOCK_M, BLOCK_N, num_warps, num_stages, chunks per prefix) of the shared-prefix tile kernel


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--context", type=int, default=1216)
    parser.add_argument("--shared", type=int, default=1024)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--model", choices=MODELS, default="qwen2.5-0.5b")
    parser.add_argument(
        "--shared-tiles", action="store_true", help="sweep the shared-prefix tile kernel's shape"
    )
    args = parser.parse_args()
    dtype, n = torch.bfloat16, args.batch
    heads, kv_heads, head_dim, layers = MODELS[args.model]
    tables = sorted(
        block_tables(n, args.context, args.shared, args.groups, BLOCK_SIZE), key=lambda t: t[0]
    )
    num_blocks = max(max(t) for t in tables) + 1
    k = torch.randn(layers, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    host_tables = np.zeros((n, max(map(len, tables))), np.int32)
    for i, t in enumerate(tables):
        host_tables[i, : len(t)] = t
    context_lens = np.full(n, args.context, np.int32)

    def plan_tiles() -> tuple[pa.SharedPrefixTiles, int]:
        """The engine planner's tiles for the kernel's current shape, and how many are used."""
        planner = SharedPrefixPlanner(
            BLOCK_SIZE, pa.shared_prefix_seqs_per_tile(heads, kv_heads, dtype)
        )
        max_tiles = planner.max_tiles(n)
        tile_seqs = np.zeros((max_tiles, planner.seqs_per_tile), np.int32)
        tile_lens, kv_starts = np.zeros(max_tiles, np.int32), np.zeros(n, np.int32)
        used = planner.plan(host_tables, context_lens, tile_seqs, tile_lens, kv_starts)
        arrays = (tile_seqs, tile_lens, kv_starts)
        return pa.SharedPrefixTiles(*(torch.from_numpy(a).cuda() for a in arrays)), used

    shared, used = plan_tiles()
    tables_dev, lens_dev = (
        torch.from_numpy(host_tables).cuda(),
        torch.from_numpy(context_lens).cuda(),
    )
    q = torch.randn(n, heads, head_dim, device="cuda", dtype=dtype)
    out = torch.empty_like(q)

    def replay_us(tiles: pa.SharedPrefixTiles | None, chunks: int | None = None) -> float:
        def step() -> None:
            for layer in range(layers):
                pa.paged_decode_attention_triton(
                    q,
                    k[layer],
                    v[layer],
                    tables_dev,
                    lens_dev,
                    args.context,
                    head_dim**-0.5,
                    out=out,
                    shared=tiles,
                    shared_chunks=chunks,
                )

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            step()  # compile outside the capture
            with torch.cuda.graph(graph, stream=stream):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    print(
        f"{torch.cuda.get_device_name()}: batch {n}, context {args.context}, {args.groups} groups sharing "
        f"{args.shared} positions ({used} tiles); {layers} layers' decode attention per graph replay, us"
    )
    if args.shared_tiles:
        default_tiles = pa._shared_prefix_config
        for block_m, block_n, warps, stages, chunks in TILE_SHAPES:
            pa._shared_prefix_config = lambda dt, s=(block_m, block_n, warps, stages): dict(  # noqa: E731
                BLOCK_M=s[0], BLOCK_N=s[1], num_warps=s[2], num_stages=s[3]
            )
            tiles, used = plan_tiles()
            print(
                f"BLOCK_M {block_m:3d} BLOCK_N {block_n:3d} warps {warps} stages {stages} chunks "
                f"{chunks:2d} ({used} tiles): shared prefix {replay_us(tiles, chunks):6.0f}"
            )
        pa._shared_prefix_config = default_tiles
        sms = num_sms(torch.device("cuda"))
        chunks = pa.shared_prefix_chunks(n, shared.seqs.shape[1], kv_heads, sms)
        print(
            f"default {default_tiles(dtype)}, chunks {chunks}: shared prefix {replay_us(shared):6.0f}"
        )
        return
    default = pa._decode_config
    for block_n, warps, stages in SHAPES:
        pa._decode_config = lambda block_d, dt, s=(block_n, warps, stages): dict(  # noqa: E731
            BLOCK_N=s[0], num_warps=s[1], num_stages=s[2]
        )
        print(
            f"BLOCK_N {block_n:3d} warps {warps} stages {stages}: shared prefix {replay_us(shared):6.0f}  "
            f"whole contexts {replay_us(None):6.0f}"
        )
    pa._decode_config = default
    print(
        f"default {default(head_dim, dtype)}: shared prefix {replay_us(shared):6.0f}  "
        f"whole contexts {replay_us(None):6.0f}"
    )


if __name__ == "__main__":
    main()
