"""Rotate-half rotary embedding (GPT-NeoX layout, transformers' Llama family): each row's halves
``(x1, x2)`` become ``(x1 cos - x2 sin, x2 cos + x1 sin)``.

No kernel of its own: the attention layer's store step applies it on the way (`kernels/store_kv.py`
rotates q in place and k into the cache in the launch that stores K and V). Here are its two halves:
`rotated`, the PyTorch reference, and `load_rotated`, the Triton helper that kernel inlines; and
`Rotary`, what the store step is given to rotate.

Eagerly ``rotate_half`` costs about seven element-wise kernels per tensor (chunk, four products, a sum, a
difference, a cat) and a copy. The store kernel rotates in float32 and rounds once; the reference rounds after
every product and sum, as the eager model in a 16-bit dtype does, so the two agree to that rounding.

Why not the eager roundings: Triton narrows a rounded float32 product to a 16-bit multiply, which the backend
then contracts with the sum into a 16-bit fused multiply-add (one rounding fewer than eager, so still not the
reference's bits). Rounding once is as accurate: qwen2.5-0.5b bf16 logits are 1.786e-2 from transformers' in
float32 on the same weights, against 1.785e-2 for transformers' own bf16 and for the eager roundings.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Rotary(NamedTuple):
    """Rotary embedding for the KV store to apply on its way: ``q`` rotated in place, k rotated as
    it is stored."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor  # [num_tokens, head_dim // 2], this token's position's row
    sin: torch.Tensor


def rotated(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim // 2], this token's position's row
    sin: torch.Tensor,
) -> torch.Tensor:  # like x
    """``x`` rotated, in x's dtype with transformers' roundings (a new tensor)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, head_dim // 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@triton.jit
def load_rotated(first, cos, sin, mask, HALF: tl.constexpr):
    """The rotated halves, in float32, of the rows whose first halves ``first`` points at (``[heads,
    half]`` pointers; the second half lies ``HALF`` further); ``cos``/``sin``: ``[1, half]`` float32."""
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin
