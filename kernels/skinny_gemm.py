"""A linear layer for one to four tokens (a small decode batch): ``y = x W^T + b`` with ``x`` ``[M, K]``,
``M <= MAX_REDUCE_M``, and ``W`` ``[N, K]`` row-major (nn.Linear's layout).

At a few tokens the matmul reads its weight once and does almost no arithmetic, so its floor is the weight's
bytes over the HBM bandwidth. cuBLAS stays well above that floor at these shapes: on an H200 each call costs
~7 us beyond its bytes (qwen2.5-0.5b's 2 MB qkv projection takes ~4.2 us for 0.5 us of reads, llama-3.1-8b's
50 MB one 19 us for 12). Here the weight is cut into tiles of ``BLOCK_N`` rows (output columns) by
``BLOCK_K`` of K, and a *persistent* grid, as many programs as the SMs hold at once, walks them::

    W [N, K]   column block c = rows [c * BLOCK_N, (c + 1) * BLOCK_N), read BLOCK_K at a time
    program p: column blocks p, p + P, p + 2P, ... (P programs), each over all of K, as one run of steps;
               every step loads the next step's weight tile before it multiplies this one

Every program gets the same number of column blocks (give or take one) and no program waits for a slot, so
no SM idles behind a last wave; each program's first tile is loaded before `wait_for_inputs`, so under
programmatic dependent launch the weight starts streaming while the kernel that writes ``x`` finishes. The
products are multiply-adds on the CUDA cores (a tensor-core tile would be at least 16 rows of padding), summed
over each tile in float32 and rounded once at the store, like cuBLAS. A column's sum does not depend on which
program computes it, so a launch's result does not depend on its grid.

How many programs an SM holds depends on the compiled kernel's registers, so it is read off the kernel at a
launch shape's first launch (which gives every column block a program of its own: the engine's eager warm-up,
before any CUDA graph is captured) and the persistent grid is used from then on (`resident_programs`).

Launch shapes come from `skinny_config`, a rule on (M, N, K) and the SM count, never from a run-time autotune:
a decode step is captured in a CUDA graph, which must not compile or benchmark, so every shape a model uses
compiles in the engine's warm-up. ``M`` is not specialised (``do_not_specialize``), so 3 and 4 tokens share
one compiled kernel. ``benchmarks/bench_skinny_gemm.py`` times it against cuBLAS at the real per-rank
shapes; `radixinfer.models.layers.use_skinny_gemm` is the rule that picks it.

`linear_silu_and_mul_triton` is the same launch over SwiGLU's fused gate/up weight (``[2 I, K]``, gate rows
then up rows) with SiLU-and-mul in its epilogue: each column block of the output walks the gate rows and the
up rows of its columns together (two half-height tiles a step, so a step reads the tile's bytes as before) and
stores ``silu(gate) * up`` (`kernels/activation.py`'s roundings), so the ``[M, 2 I]`` projection is never
written and the SiLU-and-mul launch is gone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_ref, silu_times
from kernels.device import num_sms
from kernels.pdl import launch_options, let_next_kernel_start, wait_for_inputs

MAX_REDUCE_M = 4  # the most tokens a launch takes (one token block: 1, 2 or 4 rows)
TILE_WEIGHTS = 8192  # a program's weight tile (block_n x block_k): 64 weights a thread on 4 warps
ROW_K = 4096  # the most K a weight tile spans at one token (at M tokens, ROW_K / next_pow2(M))
NUM_WARPS = 4


class GemmConfig(NamedTuple):
    """A launch shape: ``block_m`` token rows (at least M); weight tiles of ``block_n`` output columns by
    ``block_k`` of K; Triton's warps."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def tile_k(m: int, k: int) -> int:
    """A weight tile's K at ``m`` tokens: all of K up to ``ROW_K / next_pow2(m)`` (a power of two, at
    least 16). Rows of ``k <= tile_k(m, k)`` are one tile."""
    return min(ROW_K // triton.next_power_of_2(max(m, 1)), max(16, triton.next_power_of_2(k)))


def skinny_config(m: int, n: int, k: int, sms: int, gated: bool = False) -> GemmConfig:
    """The launch shape for ``[m, k] @ [n, k]^T``, ``1 <= m <= MAX_REDUCE_M``, on a device of ``sms`` SMs;
    ``gated``: for `linear_silu_and_mul_triton`, whose ``n`` weight rows are gate and up, each tile half
    of each (``block_n`` is then each half's height: the launch shape of the ``n``-row matmul, halved).

    - ``block_m``: ``next_pow2(m)`` (1, 2 or 4).
    - ``block_k``: `tile_k`, all of K up to ``ROW_K / block_m`` (at one token llama-3.1-8b's K of 4,096 in
      one tile).
    - ``block_n``: the rest of a `TILE_WEIGHTS` tile (at most 16), halved while there are fewer than two
      column blocks per SM (qwen2.5-0.5b's 896 and 1,152 columns).
    - `NUM_WARPS` warps.

    On an H200 (``benchmarks/bench_skinny_gemm.py --sweep``, tiles of 1-8 columns by 1,024-4,096 of K) it
    is the best tile at one token for llama-3.1-8b's qkv, o_proj and gate_up at TP 1 and 2 (1/2/4,096) and
    for qwen2.5-0.5b's gate_up and down_proj; 1/4/2,048 is 6% faster on llama-3.1-8b's down_proj at TP=1
    (35.2 against 37.5 us). At two tokens 2/4/2,048 is the best for llama-3.1-8b.
    """
    assert 1 <= m <= MAX_REDUCE_M, m
    block_m = triton.next_power_of_2(m)
    block_k = tile_k(m, k)
    block_n = min(16, TILE_WEIGHTS // block_k)
    while block_n > 1 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    if gated:
        block_n = max(1, block_n // 2)
    return GemmConfig(block_m, block_n, block_k, NUM_WARPS)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [M, K], [N, K], [N] -> [M, N]
    return F.linear(x, weight, bias)


def linear_silu_and_mul_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [M, K], [2 I, K] (gate | up), [2 I] -> [M, I]
    return silu_and_mul_ref(F.linear(x, weight, bias))


@triton.jit
def _tile_coords(step, first_block, blocks_step, k_tiles, offs_n, offs_k, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """The columns and K offsets of a program's ``step``-th tile: column block ``first_block + (step //
    k_tiles) * blocks_step``, K tile ``step % k_tiles``."""
    cols = (first_block + (step // k_tiles) * blocks_step) * BLOCK_N + offs_n
    return cols, (step % k_tiles) * BLOCK_K + offs_k


@triton.jit
def _weight_tile(w_ptr, step, first_block, blocks_step, k_tiles, num_steps, N, K, offs_n, offs_k,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """A program's ``step``-th weight tile (`_tile_coords`); all masked off (nothing read) past the
    program's last step."""
    cols, ks = _tile_coords(
        step, first_block, blocks_step, k_tiles, offs_n, offs_k, BLOCK_N, BLOCK_K
    )
    mask = (cols < tl.where(step < num_steps, N, 0))[:, None] & (ks < K)[None, :]
    return tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :], mask=mask, other=0.0)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for the token counts of a block_m
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program p owns column blocks p, p + P, ... (P programs) and walks them one K tile at a time, as one
    run of steps, loading each step's next weight tile before it multiplies this one, across block
    boundaries too. A block's ``[BLOCK_M, BLOCK_N]`` sums are stored after its last K tile.

    ``GATED``: the weight holds ``2 N`` rows, gate then up; each step loads a column block's gate tile and
    its up tile (rows ``N`` further), and the store writes ``silu(gate) * up`` with `silu_and_mul`'s
    roundings (each sum rounded to the dtype first, as the unfused projection's output would be)."""
    let_next_kernel_start(USE_PDL)
    first, programs = tl.program_id(0), tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_steps = tl.cdiv(tl.cdiv(N, BLOCK_N) - first, programs) * k_tiles
    rows, offs_n, offs_k = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    row_mask = rows < M
    # the first tile's weight, before the wait: nothing in the step writes it
    w = _weight_tile(
        w_ptr, 0, first, programs, k_tiles, num_steps, N, K, offs_n, offs_k, BLOCK_N, BLOCK_K
    )
    if GATED:
        up_ptr = w_ptr + N.to(tl.int64) * K  # the up rows
        w_up = _weight_tile(
            up_ptr, 0, first, programs, k_tiles, num_steps, N, K, offs_n, offs_k, BLOCK_N, BLOCK_K
        )
    wait_for_inputs(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, num_steps):
        next_w = _weight_tile(
            w_ptr, step + 1, first, programs, k_tiles, num_steps, N, K, offs_n, offs_k, BLOCK_N, BLOCK_K
        )  # fmt: skip
        if GATED:
            next_w_up = _weight_tile(
                up_ptr, step + 1, first, programs, k_tiles, num_steps, N, K, offs_n, offs_k, BLOCK_N,
                BLOCK_K,
            )  # fmt: skip
        cols, ks = _tile_coords(step, first, programs, k_tiles, offs_n, offs_k, BLOCK_N, BLOCK_K)
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
        x = tl.load(x_ptrs, mask=row_mask[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
        if GATED:
            acc_up += tl.sum(x[:, None, :] * w_up.to(tl.float32)[None, :, :], axis=2)
        if step % k_tiles == k_tiles - 1:  # the block's last K tile
            col_mask = cols < N
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                if GATED:
                    up_bias = tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0)
                    acc_up += up_bias.to(tl.float32)[None, :]
            if GATED:
                dtype = out_ptr.dtype.element_ty
                gate = acc.to(dtype).to(tl.float32)  # rounded as the projection would store it
                up = acc_up.to(dtype).to(tl.float32)
                acc = silu_times(gate, up, dtype)
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            out_mask = row_mask[:, None] & col_mask[None, :]
            tl.store(out_ptrs, acc, mask=out_mask)  # rounds to the dtype
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if GATED:
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w = next_w
        if GATED:
            w_up = next_w_up


# (device, dtype, config, bias, gated) -> how many programs of that compiled kernel an SM holds at once,
# learnt at its first launch (which gives every column block a program of its own). A persistent grid asks
# for no more: programs beyond it would start only as others finish, and run on alone at the end.
_resident: dict[tuple, int] = {}


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, K] (any token stride), [N, K], [N] -> [M, N] contiguous
    """Same function as `linear_ref` in float16/bfloat16 for ``M <= MAX_REDUCE_M`` tokens, in one launch
    (``config``: `skinny_config`'s when None; its ``block_m`` must cover M)."""
    return _launch(x, weight, bias, config, gated=False)


def linear_silu_and_mul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, K] (any token stride), [2 I, K] (gate | up), [2 I] -> [M, I] contiguous
    """Same function as `linear_silu_and_mul_ref` (SwiGLU's gate over the fused gate/up projection) in
    float16/bfloat16 for ``M <= MAX_REDUCE_M`` tokens, in one launch (``config``: `skinny_config`'s with
    ``gated`` when None)."""
    return _launch(x, weight, bias, config, gated=True)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig | None,
    gated: bool,
) -> torch.Tensor:
    """One launch of the kernel: `linear_triton`'s, or with ``gated`` `linear_silu_and_mul_triton`'s."""
    m, k = x.shape
    rows = weight.shape[0]
    n = rows // 2 if gated else rows  # output columns
    assert m <= MAX_REDUCE_M and weight.shape[1] == k and (not gated or rows % 2 == 0)
    assert weight.is_contiguous() and x.stride(1) == 1
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16)
    assert bias is None or bias.shape == (rows,) and bias.is_contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    sms = num_sms(x.device)
    cfg = config or skinny_config(m, rows, k, sms, gated)
    assert cfg.block_m >= m
    key = (x.device, x.dtype, cfg, bias is not None, gated)
    blocks = triton.cdiv(n, cfg.block_n)
    grid = min(blocks, _resident[key] * sms) if key in _resident else blocks
    compiled = _skinny_gemm_kernel[(grid,)](
        x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0), HAS_BIAS=bias is not None,
        GATED=gated, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=1, **launch_options(x.device),
    )  # fmt: skip
    if key not in _resident:
        _resident[key] = resident_programs(x.device, compiled, cfg.num_warps)
    return out


def resident_programs(device: torch.device, compiled, num_warps: int) -> int:
    """Programs of ``compiled`` (a Triton kernel launched with ``num_warps``) one SM of ``device`` holds at
    once: what its registers, threads and shared memory allow (Hopper hands out registers per warp in
    units of 256). 1 off CUDA: Triton's interpreter then runs one program over every column block."""
    if device.type != "cuda":
        return 1
    props = torch.cuda.get_device_properties(device)
    warp_regs = -(-compiled.n_regs * 32 // 256) * 256
    limits = [
        getattr(props, "regs_per_multiprocessor", 65536) // (warp_regs * num_warps),
        props.max_threads_per_multi_processor // (32 * num_warps),
    ]
    if compiled.metadata.shared:
        limits.append(
            getattr(props, "shared_memory_per_multiprocessor", 233472) // compiled.metadata.shared
        )
    return max(1, min(limits))
