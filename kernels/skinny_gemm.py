"""A linear layer for a few tokens (a decode batch): ``y = x W^T + b`` with ``x`` ``[M, K]``, M small, and
``W`` ``[N, K]`` row-major (nn.Linear's layout); optionally fused with SwiGLU's gate, ``silu(x Wg^T) * (x Wu^T)``
over a gate/up weight ``[2 * I, K]`` (gate rows, then up rows), which saves the activation's launch and its
``[M, 2 * I]`` round trip.

At a handful of tokens the matmul reads its weight once and does almost no arithmetic, so its floor is the
weight's bytes over the HBM bandwidth. cuBLAS runs these shapes at a fraction of that (on an H200, qwen2.5-0.5b's
96 matmuls of a batch-1 decode step take ~0.59 ms where their weights read in ~0.16 ms; llama-3.1-8b's per-rank
shapes under tensor parallelism fall from 88% to 75% of the bandwidth). Here each program owns ``BLOCK_N`` output
columns for every token and walks K once, so the weight streams through in one pass, each row read
contiguously::

    x [M, K]  (all rows, BLOCK_K at a time: tiny, stays in L1/L2)
    W [N, K]  ---- program p reads rows [p * BLOCK_N, (p + 1) * BLOCK_N), all of K --->  y[:, those columns]

Up to `MAX_REDUCE_M` tokens the products are multiply-adds on the CUDA cores, summed over K once at the end
(a tensor-core tile would be at least 16 rows of padding); beyond, ``tl.dot`` on ``max(16, next_pow2(M))``
rows. Both accumulate in float32 and round once at the store, like cuBLAS; the fused gate rounds like
`kernels.activation` (the projection's outputs to the model dtype, then silu, then the product).

Launch shapes come from `skinny_config`, a rule on (M bucket, N, K) and the SM count, never from a run-time
autotune: a decode step is captured in a CUDA graph, which must not compile or benchmark, so every shape a
model uses compiles in the engine's warm-up. ``M`` is not specialised (``do_not_specialize``), so batch sizes
of one bucket share one compiled kernel, and N and K are plain integers (specialised only on divisibility by
16), so the layers of a model share a config's kernel too. ``benchmarks/bench_skinny_gemm.py`` sweeps the
configs against cuBLAS at the real per-rank shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_ref
from kernels.device import num_sms

MAX_REDUCE_M = 4  # up to this many tokens, CUDA-core multiply-adds; beyond, tl.dot
PROGRAMS_PER_SM = 2  # the grid aims at this many programs per SM, so every SM streams weight rows
# Products a CUDA-core program accumulates at once (block_m * block_n * block_k, float32), over all
# accumulators: 32 registers a thread at 8 warps, ~120 in all (ptxas for sm_90a), so two programs fit an SM
# and a grid of PROGRAMS_PER_SM per SM runs in one wave (at 16,384, ~220 registers: one program an SM).
REDUCE_PRODUCTS = 8192


class GemmConfig(NamedTuple):
    """A launch shape: ``block_m`` tokens (below 16: the CUDA-core path; 16 or more: ``tl.dot``), ``block_n``
    output columns per program, ``block_k`` of K per iteration, and Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def skinny_config(m: int, n: int, k: int, sms: int, silu_and_mul: bool = False) -> GemmConfig:
    """The launch shape for ``[m, k] @ [n, k]^T`` on a device of ``sms`` SMs (``n``: output columns; for
    the fused gate, the intermediate size, with two accumulators).

    The weight is read once whatever the tile, so the choice is about keeping every SM streaming:

    - ``block_n``: the largest power of two that still gives ``PROGRAMS_PER_SM`` programs per SM (the grid
      is ``cdiv(n, block_n)``; fewer programs leave SMs idle), within 4 to 16 columns on the CUDA cores
      (8 fused) and 16 to 64 for ``tl.dot`` (32 fused; its smallest tile is 16).
    - ``block_k`` on the CUDA cores: what `REDUCE_PRODUCTS` leaves (one token, 4 columns: 2,048 of K,
      16 KB of weight an iteration), since one iteration's loads are all a program has in flight (the
      loop is not software-pipelined there); for ``tl.dot``, 128 (64 columns: 16 KB a stage), four stages.
    - warps: 8 on the CUDA cores; for ``tl.dot``, 8 from 2,048 float32 accumulator values a program (4
      warps spill there: ptxas for sm_90a), else 4.

    Small problems (qwen2.5-0.5b's o_proj and down_proj: 896 columns) cannot fill an H200's 132 SMs even
    at the smallest tile; a split over K would need a second launch or a cross-program reduction and is
    not done. This is a first rule, checked for spills but not yet timed: ``benchmarks/bench_skinny_gemm.py``
    sweeps its neighbours on the GPU.
    """
    accumulators = 2 if silu_and_mul else 1
    if m <= MAX_REDUCE_M:
        block_m, lo, hi = triton.next_power_of_2(m), 4, 16 // accumulators
    else:
        block_m, lo, hi = min(64, max(16, triton.next_power_of_2(m))), 16, 64 // accumulators
    block_n = hi
    while block_n > lo and triton.cdiv(n, block_n) < PROGRAMS_PER_SM * sms:
        block_n //= 2
    if block_m >= 16:
        block_k = min(128, max(16, triton.next_power_of_2(k)))
        num_warps = 8 if accumulators * block_m * block_n >= 2048 else 4
        return GemmConfig(block_m, block_n, block_k, num_warps, num_stages=4)
    products = REDUCE_PRODUCTS // accumulators
    block_k = min(4096, products // (block_m * block_n), max(16, triton.next_power_of_2(k)))
    return GemmConfig(block_m, block_n, block_k, num_warps=8, num_stages=1)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [M, K], [N, K], [N] -> [M, N]
    return F.linear(x, weight, bias)


def linear_silu_and_mul_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [M, K], [2 * I, K] (gate | up), [2 * I] -> [M, I]
    return silu_and_mul_ref(F.linear(x, weight, bias))


@triton.jit
def _accumulate(acc, x, w, BLOCK_M: tl.constexpr):
    """``acc += x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T`` in float32: ``acc`` ``[BLOCK_M, BLOCK_N]``
    through ``tl.dot``; below 16 tokens ``[BLOCK_M, BLOCK_N, BLOCK_K]`` products, summed over K only once
    at the end (`_sum_k`), so the loop makes no cross-thread reduction."""
    if BLOCK_M >= 16:
        acc = tl.dot(x, tl.trans(w), acc)
    else:
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _sum_k(acc, BLOCK_M: tl.constexpr):
    """`_accumulate`'s accumulator -> ``[BLOCK_M, BLOCK_N]``."""
    if BLOCK_M < 16:
        acc = tl.sum(acc, axis=2)
    return acc


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for a block_m bucket's token counts
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_AND_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (column block, token block): ``out[rows, cols]`` for ``BLOCK_N`` columns and ``BLOCK_M`` tokens,
    over all of K. ``SILU_AND_MUL``: ``w`` holds ``2 * N`` rows (gate, then up) and the program reads the
    gate rows ``cols`` and the up rows ``N + cols``."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptrs + N * K  # SILU_AND_MUL only
    if BLOCK_M >= 16:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros_like(acc)  # SILU_AND_MUL only
    for k0 in range(0, K, BLOCK_K):
        x_mask, w_mask = row_mask[:, None], col_mask[:, None]  # broadcast along K
        if not EVEN_K:  # no K mask when BLOCK_K divides K
            k_mask = offs_k[None, :] < K - k0
            x_mask, w_mask = x_mask & k_mask, w_mask & k_mask
        x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0)
        acc = _accumulate(acc, x, tl.load(w_ptrs + k0, mask=w_mask, other=0.0), BLOCK_M)
        if SILU_AND_MUL:
            acc_up = _accumulate(acc_up, x, tl.load(up_ptrs + k0, mask=w_mask, other=0.0), BLOCK_M)
    acc, acc_up = _sum_k(acc, BLOCK_M), _sum_k(acc_up, BLOCK_M)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_AND_MUL:
            acc_up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if SILU_AND_MUL:  # the roundings of F.linear, then `kernels.activation`
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])  # rounds to the model dtype


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_and_mul: bool,
    config: GemmConfig | None,
) -> torch.Tensor:
    m, k = x.shape
    rows = weight.shape[0]
    assert weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16)
    assert bias is None or bias.shape == (rows,) and bias.is_contiguous()
    assert not silu_and_mul or rows % 2 == 0
    n = rows // 2 if silu_and_mul else rows
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or skinny_config(m, n, k, num_sms(x.device), silu_and_mul)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _skinny_gemm_kernel[grid](
        x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0),
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, K] (any token stride), [N, K], [N] -> [M, N] contiguous
    """Same function as `linear_ref` in float16/bfloat16, in one launch (``config``: `skinny_config`'s when
    None). Any M is computed (token blocks of ``block_m``, each reading the weight again); it is meant
    for a few."""
    return _launch(x, weight, bias, silu_and_mul=False, config=config)


def linear_silu_and_mul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, K], [2 * I, K] (gate | up), [2 * I] -> [M, I] contiguous
    """Same function as `linear_silu_and_mul_ref`, in one launch; ``config`` as `linear_triton`'s, for
    ``N = I``."""
    return _launch(x, weight, bias, silu_and_mul=True, config=config)
