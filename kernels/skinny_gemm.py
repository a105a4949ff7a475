"""A linear layer for one to four tokens (a small decode batch): ``y = x W^T + b`` with ``x`` ``[M, K]``,
``M <= MAX_REDUCE_M``, and ``W`` ``[N, K]`` row-major (nn.Linear's layout).

At a few tokens the matmul reads its weight once and does almost no arithmetic, so its floor is the weight's
bytes over the HBM bandwidth. On small weights cuBLAS stays far from that floor: on an H200 it takes ~4.3 us
for qwen2.5-0.5b's 2 MB qkv projection, whose bytes read in ~0.5 us, so such a launch is latency-bound.
Here each program owns ``BLOCK_N`` output columns for every token and walks K once, so the weight streams
through in one pass, each row read contiguously, and the products are multiply-adds on the CUDA cores, summed
over K once at the end (a tensor-core tile would be at least 16 rows of padding)::

    x [M, K]  (all rows, BLOCK_K at a time: tiny, stays in L1/L2)
    W [N, K]  ---- program p reads rows [p * BLOCK_N, (p + 1) * BLOCK_N), all of K --->  y[:, those columns]

It accumulates in float32 and rounds once at the store, like cuBLAS. It beats cuBLAS only on such small
weights (measured numbers in docs/kernels.md); `radixinfer.models.layers.use_skinny_gemm` is the rule
that picks it.

Launch shapes come from `skinny_config`, a rule on (M, N, K) and the SM count, never from a run-time
autotune: a decode step is captured in a CUDA graph, which must not compile or benchmark, so every shape a
model uses compiles in the engine's warm-up. ``M`` is not specialised (``do_not_specialize``), so 3 and 4
tokens share one compiled kernel, and N and K are plain integers (specialised only on divisibility by 16),
so the layers of a model share a config's kernel too. ``benchmarks/bench_skinny_gemm.py`` times it against
cuBLAS at the real per-rank shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.device import num_sms
from kernels.pdl import launch_options, let_next_kernel_start, wait_for_inputs

MAX_REDUCE_M = 4  # the most tokens a launch takes (one token block: 1, 2 or 4 rows)
PROGRAMS_PER_SM = 2  # the grid aims at this many programs per SM, so every SM streams weight rows
# Products a program accumulates at once (block_m * block_n * block_k, float32): 64 registers a thread
# at 4 warps. An iteration's loads (its x tile and the next weight tile) are all a program has in flight,
# so K tiles are as long as this allows.
REDUCE_PRODUCTS = 8192
NUM_WARPS = 4  # at one token, the sweep's best on an H200 for every weight the layers' rule admits


class GemmConfig(NamedTuple):
    """A launch shape: ``block_m`` token rows (at least M), ``block_n`` output columns per program,
    ``block_k`` of K per iteration, and Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def skinny_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """The launch shape for ``[m, k] @ [n, k]^T``, ``1 <= m <= MAX_REDUCE_M``, on a device of ``sms`` SMs.

    The weight is read once whatever the tile, so the choice is about keeping every SM streaming:

    - ``block_m``: ``next_pow2(m)`` (1, 2 or 4).
    - ``block_n``: the largest power of two from 4 to 16 that still gives ``PROGRAMS_PER_SM`` programs
      per SM (the grid is ``cdiv(n, block_n)``; fewer programs leave SMs idle).
    - ``block_k``: what `REDUCE_PRODUCTS` leaves, at most 4,096 (one token, 4 columns: 2,048 of K, 16 KB
      of weight an iteration).
    - `NUM_WARPS` warps, one stage.

    At one token this is the best launch shape of ``benchmarks/bench_skinny_gemm.py``'s sweep on an H200
    for qwen2.5-0.5b's qkv, o_proj and down_proj (1/4/1024, 1/4/1024 and 1/4/2048 on 4 warps); 2 and 4
    tokens take the same rule untimed. Narrow problems (896 columns) cannot fill an H200's 132 SMs even
    at 4 columns a program; a split over K would need a second launch and is not done.
    """
    assert 1 <= m <= MAX_REDUCE_M, m
    block_m = triton.next_power_of_2(m)
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < PROGRAMS_PER_SM * sms:
        block_n //= 2
    block_k = min(4096, REDUCE_PRODUCTS // (block_m * block_n), max(16, triton.next_power_of_2(k)))
    return GemmConfig(block_m, block_n, block_k, NUM_WARPS, num_stages=1)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [M, K], [N, K], [N] -> [M, N]
    return F.linear(x, weight, bias)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for the token counts of a block_m
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program p: ``out[:, cols]`` for ``BLOCK_N`` columns and all ``M <= BLOCK_M`` tokens, over all of K,
    as ``[BLOCK_M, BLOCK_N, BLOCK_K]`` products summed over K once after the loop (no cross-thread
    reduction per iteration). Each iteration loads the next weight tile before it multiplies this one, so the
    first tile (all of a narrow K) is read before `wait_for_inputs`: under PDL it streams while the kernel that
    writes ``x`` finishes."""
    let_next_kernel_start(USE_PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    col_mask_2d = col_mask[:, None]  # broadcast along K
    if EVEN_K:  # no K mask when BLOCK_K divides K (so the loads stay vectorised)
        w = tl.load(w_ptrs, mask=col_mask_2d, other=0.0)
    else:
        w = tl.load(w_ptrs, mask=col_mask_2d & (offs_k[None, :] < K), other=0.0)
    wait_for_inputs(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # x's tile, and the next weight tile (none after the last: a load masked off everywhere reads nothing)
        if EVEN_K:
            x_mask, next_mask = row_mask[:, None], col_mask_2d & (k0 + BLOCK_K < K)
        else:
            x_mask = row_mask[:, None] & (offs_k[None, :] < K - k0)
            next_mask = col_mask_2d & (offs_k[None, :] < K - k0 - BLOCK_K)
        x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0).to(tl.float32)
        next_w = tl.load(w_ptrs + k0 + BLOCK_K, mask=next_mask, other=0.0)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        w = next_w
    out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, out, mask=row_mask[:, None] & col_mask[None, :])  # rounds to the model dtype


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, K] (any token stride), [N, K], [N] -> [M, N] contiguous
    """Same function as `linear_ref` in float16/bfloat16 for ``M <= MAX_REDUCE_M`` tokens, in one launch
    (``config``: `skinny_config`'s when None; its ``block_m`` must cover M)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_REDUCE_M and weight.shape[1] == k
    assert weight.is_contiguous() and x.stride(1) == 1
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16)
    assert bias is None or bias.shape == (n,) and bias.is_contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or skinny_config(m, n, k, num_sms(x.device))
    assert cfg.block_m >= m
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0),
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device),
    )  # fmt: skip
    return out
