"""SwiGLU's gate: ``silu(gate) * up`` over the fused gate/up projection's output, in one pass.

Eagerly that is two kernels (silu, then the product) and an intermediate tensor. The roundings are the eager
model's: silu computed in float32 and rounded to the model dtype, then the product of the two rounded values
computed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import launch_options, let_next_kernel_start, wait_for_inputs


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] (gate | up) -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu_times(gate, up, DTYPE: tl.constexpr):
    """``silu(gate) * up`` in float32 with the eager model's roundings: SiLU rounded to ``DTYPE`` before
    the product, which the caller's store rounds. ``gate`` and ``up``: float32 holding ``DTYPE`` values
    (the projection's output as the eager model would have stored it). The fused gate/up projection's
    epilogue (`kernels/skinny_gemm.py`) computes it too."""
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return act * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_xt, INTER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """Program (token, block): ``BLOCK`` columns of one token's output."""
    let_next_kernel_start(USE_PDL)
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + INTER + cols, mask=mask).to(tl.float32)
    out = silu_times(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * INTER + cols, out, mask=mask)  # the store rounds to the model dtype


def silu_and_mul_triton(
    x: torch.Tensor,
) -> torch.Tensor:  # [T, 2 * I], any token stride -> [T, I] contiguous
    """Same function as `silu_and_mul_ref`, in one launch."""
    num_tokens, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), INTER=inter, BLOCK=block, **launch_options(x.device)
    )
    return out
