"""RMSNorm, optionally fused with the residual add before it (vLLM's ``fused_add_rms_norm``).

A pre-norm decoder layer computes ``residual = out + residual; x = norm(residual)`` twice per layer; eagerly
that is one add and about seven element-wise kernels, each a pass over the hidden states. Here it is one
pass. The roundings are transformers' LlamaRMSNorm's, so the kernel differs from the reference only in the
order of the float32 sum of squares:

    residual = round(x + residual)                             # the eager ``h = h + out`` in the model dtype
    out = round(weight * round(r * rsqrt(mean(r * r) + eps)))  # r = residual in float32; products in float32
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, let_next_kernel_start, wait_for_inputs


def rms_norm_ref(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor,  # [dim], the model dtype
    eps: float,
    residual: torch.Tensor | None = None,  # like x
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(norm(x + residual), x + residual)``; with no residual, ``(norm(x), x)``."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,  # x, residual: [num_tokens, num_rows, dim], last stride 1
    eps,
    NUM_ROWS: tl.constexpr,
    DIM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per token: each of its rows (one hidden state, or one per head) normalised on its own.
    The weight is read before `wait_for_inputs` (no kernel writes it)."""
    let_next_kernel_start(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_R)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < NUM_ROWS) & (dims < DIM)
    weight = tl.load(weight_ptr + dims, mask=dims < DIM, other=0.0).to(tl.float32)
    wait_for_inputs(USE_PDL)
    x = tl.load(x_ptr + token * stride_xt + rows * stride_xh + dims, mask=mask, other=0.0)
    dst = token * NUM_ROWS * DIM + rows * DIM + dims  # out, new_residual: contiguous
    if HAS_RESIDUAL:
        r = tl.load(
            residual_ptr + token * stride_rt + rows * stride_rh + dims, mask=mask, other=0.0
        )
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + dst, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / DIM + eps)  # [BLOCK_R]; padding adds zeros
    normed = (x32 * inv_rms[:, None]).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + dst, normed * weight, mask=mask)  # the store rounds to the model dtype


def rms_norm_triton(
    x: torch.Tensor,  # [num_tokens, dim] or [num_tokens, num_heads, dim]; any strides but the last (1)
    weight: torch.Tensor,  # [dim], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # like x
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same function as `rms_norm_ref`, in one launch of ``num_tokens`` programs. The outputs are new
    contiguous tensors; with no residual the second one is ``x`` itself. 3-D inputs (per-head q/k norms)
    may be strided views of a fused qkv projection."""
    assert weight.dtype == x.dtype and weight.is_contiguous() and x.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty_like(out)
    x3 = x if x.dim() == 3 else x[:, None]  # [num_tokens, num_rows, dim]
    r3 = x3 if residual is None else (residual if residual.dim() == 3 else residual[:, None])
    assert r3.shape == x3.shape and r3.dtype == x.dtype and r3.stride(-1) == 1
    num_tokens, num_rows, dim = x3.shape
    if num_tokens == 0:
        return out, new_residual
    block_r, block_d = triton.next_power_of_2(num_rows), triton.next_power_of_2(dim)
    _rms_norm_kernel[(num_tokens,)](
        x3,
        r3,
        weight,
        out,
        new_residual,
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        eps,
        NUM_ROWS=num_rows,
        DIM=dim,
        HAS_RESIDUAL=residual is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=min(max(block_r * block_d // 512, 1), 16),
        **launch_options(x.device),
    )
    return out, new_residual
