"""Rotate-half rotary embedding (GPT-NeoX layout, transformers' Llama family): each row's halves
``(x1, x2)`` become ``(x1 cos - x2 sin, x2 cos + x1 sin)``.

No kernel of its own: the attention layer's store step applies it on the way (`kernels/store_kv.py`
rotates q in place and k into the cache in the launch that stores K and V; at decode without
shared-prefix tiles the decode attention's split kernel stores K and V itself and rotates q in
registers, `kernels/paged_attention.py`). Here are `rotated`, the PyTorch reference; the Triton helpers
those kernels inline: `load_cos_sin` (a token's cos/sin rows), `load_rotated` (a row's two halves apart)
and `load_rotated_rows` (whole rows, from `load_rotated`, so both give the same bits); and `Rotary`, what
the store step is given to rotate.

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
def load_cos_sin(cos_row, sin_row, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """A token's cos and sin rows (pointers to their first element), ``[1, BLOCK_HALF]`` float32, as
    `load_rotated` takes them."""
    half = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_row + half, mask=half < HALF).to(tl.float32)
    sin = tl.load(sin_row + half, mask=half < HALF).to(tl.float32)
    return cos, sin


@triton.jit
def load_rotated(first, cos, sin, mask, HALF: tl.constexpr):
    """The rotated halves, in float32, of the rows whose first halves ``first`` points at (``[heads,
    half]`` pointers; the second half lies ``HALF`` further); ``cos``/``sin``: ``[1, half]`` float32
    (or as wide as ``first``). Masked elements read as 0, so they give 0 where cos and sin are finite."""
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def load_rotated_rows(rows, cos_row, sin_row, mask, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rotated rows, in float32 ``[heads, BLOCK_D]`` laid out as in memory (first half, then
    second), of the rows starting at ``rows`` (``[heads, 1]`` pointers); ``cos_row``/``sin_row``:
    the token's cos/sin row. Element ``d`` is `load_rotated`'s output at ``d % HALF`` of its half,
    the same float32 operations, so q rotated here matches q rotated by the store kernel bit for
    bit. ``mask`` (``[heads, BLOCK_D]``) must exclude ``d >= 2 * HALF``; masked elements are 0."""
    dims = tl.arange(0, BLOCK_D)[None, :]
    half = dims % HALF
    in_row = dims < 2 * HALF
    cos = tl.load(cos_row + half, mask=in_row, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + half, mask=in_row, other=0.0).to(tl.float32)
    first, second = load_rotated(rows + half, cos, sin, mask, HALF)
    return tl.where(dims < HALF, first, second)
