"""Rotate-half rotary embedding (GPT-NeoX layout, transformers' Llama family), applied to q and k in place.

Eagerly ``rotate_half`` costs about seven element-wise kernels per tensor (chunk, four products, a sum, a
difference, a cat) and a copy; here q and k are rotated in one launch. Each row's halves ``(x1, x2)`` become
``(x1 cos - x2 sin, x2 cos + x1 sin)``. The kernel computes in float32 and rounds once; the reference rounds
after every product and sum, as the eager model in a 16-bit dtype does, so the two agree to that rounding.

Why not the eager roundings: Triton narrows a rounded float32 product to a 16-bit multiply, which the backend
then contracts with the sum into a 16-bit fused multiply-add (one rounding fewer than eager, so still not the
reference's bits). Rounding once is as accurate: qwen2.5-0.5b bf16 logits are 1.786e-2 from transformers' in
float32 on the same weights, against 1.785e-2 for transformers' own bf16 and for the eager roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, head_dim // 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim // 2], this token's position's row
    sin: torch.Tensor,
) -> None:
    q.copy_(_rotated(q, cos, sin))
    k.copy_(_rotated(k, cos, sin))


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_t,
    stride_h,
    token,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate all heads of one token of ``x`` in place; ``cos``/``sin``: [1, BLOCK_HALF] float32."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    tl.store(first, x1 * cos - x2 * sin, mask=mask)  # the store rounds to x's dtype
    tl.store(first + HALF, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,  # q, k: [T, heads, head_dim]; cos, sin: [T, half]
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token: its cos/sin row read once, then every q head and every k head rotated."""
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_ct + dims, mask=dims < HALF).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_ct + dims, mask=dims < HALF).to(tl.float32)
    _rotate_heads(
        q_ptr, stride_qt, stride_qh, token, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr, stride_kt, stride_kh, token, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF
    )


def rotary_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]; any token/head strides, last dim contiguous
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; likewise
    cos: torch.Tensor,  # [num_tokens, head_dim // 2]
    sin: torch.Tensor,
) -> None:
    """Same function as `rotary_ref`, in one launch of ``num_tokens`` programs. ``q`` and ``k`` may be views
    into one fused qkv projection (they must not overlap)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape == (num_tokens, num_k_heads, head_dim) and head_dim % 2 == 0
    assert cos.shape == sin.shape == (num_tokens, head_dim // 2) and cos.stride() == sin.stride()
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=head_dim // 2,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )
