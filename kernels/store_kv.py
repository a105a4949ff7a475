"""The store step of attention: the new tokens' K/V into their paged slots, with rotary embedding on
the way for the models that use it.

Given a `Rotary` (the Llama family), q is rotated in place and k is rotated as it is copied into the
cache (`kernels/rotary.py`), in the same launch that stores K and V: at decode's small batches every
element-wise launch costs about as much as the work in it, and this one replaces two. ``k`` and ``v``
themselves are only read: attention reads K and V from the cache, never from the projections. Without
one (GPT-2: learned positions) it is a plain store.

At decode without shared-prefix tiles this launch does not run: the decode attention's split kernel
stores each sequence's new K and V itself (`kernels/paged_attention.py`), through the same helper,
`store_kv_rows`, as this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, let_next_kernel_start, wait_for_inputs
from kernels.rotary import Rotary, load_cos_sin, load_rotated, rotated


def store_kv_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip (already stored / padding)
    rotary: Rotary | None = None,
) -> None:
    if rotary is not None:
        q, cos, sin = rotary
        q.copy_(rotated(q, cos, sin))
        k = rotated(k, cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


@triton.jit
def slot_offset(slot, BLOCK_SIZE: tl.constexpr, stride_cb, stride_cs):
    """Where slot ``slot`` (int64) starts in a cache ``[num_blocks, BLOCK_SIZE, heads, head_dim]`` of
    block and position strides ``stride_cb``/``stride_cs``, in elements (its head 0)."""
    return (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs


@triton.jit
def store_kv_rows(
    k_row,
    v_row,
    k_dst,
    v_dst,
    mask,
    cos,
    sin,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROTARY: tl.constexpr,
):
    """One token's K and V rows into its cache slot, the heads ``mask`` holds: ``k_row``/``v_row``
    point at each head's row of k and v, ``k_dst``/``v_dst`` at its row of the caches (``[heads, 1]``
    pointers and mask, or one head's scalar pointers and a ``[1, 1]`` mask). With ROTARY k is rotated on the
    way by ``cos``/``sin`` (``[1, BLOCK_HALF]`` float32), rounded to k's dtype as q is, then by the
    store to the cache's; otherwise, and for v, the store casts. ``k`` and ``v`` are only read."""
    dims = tl.arange(0, BLOCK_D)[None, :]
    row_mask = mask & (dims < HEAD_DIM)
    if ROTARY:
        HALF: tl.constexpr = HEAD_DIM // 2
        half = tl.arange(0, BLOCK_HALF)[None, :]
        k_mask = mask & (half < HALF)
        k1, k2 = load_rotated(k_row + half, cos, sin, k_mask, HALF)
        k_dtype = k_row.dtype.element_ty
        tl.store(k_dst + half, k1.to(k_dtype), mask=k_mask)
        tl.store(k_dst + HALF + half, k2.to(k_dtype), mask=k_mask)
    else:
        tl.store(k_dst + dims, tl.load(k_row + dims, mask=row_mask), mask=row_mask)
    tl.store(v_dst + dims, tl.load(v_row + dims, mask=row_mask), mask=row_mask)


@triton.jit
def _store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,  # q, k, v: [num_tokens, heads, head_dim], last stride 1
    stride_ct,  # cos, sin: [num_tokens, head_dim // 2], last stride 1
    stride_cb,
    stride_cs,
    stride_ch,  # both caches: [num_blocks, block_size, num_kv_heads, head_dim]
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROTARY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per token: with ``ROTARY``, its cos/sin row read once, every q head rotated in
    place (slot -1 included: padding rows and cached tokens still attend), then all heads of its K
    and V row into one slot, k rotated; slot -1 stores nothing."""
    let_next_kernel_start(USE_PDL)
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cos, sin = None, None  # read only with ROTARY
    if ROTARY:
        HALF: tl.constexpr = HEAD_DIM // 2
        half = tl.arange(0, BLOCK_HALF)[None, :]
        cos, sin = load_cos_sin(
            cos_ptr + token * stride_ct, sin_ptr + token * stride_ct, HALF, BLOCK_HALF
        )
        q_heads = tl.arange(0, BLOCK_QH)[:, None]
        q_mask = (q_heads < NUM_Q_HEADS) & (half < HALF)
        q_first = q_ptr + token * stride_qt + q_heads * stride_qh + half
        q1, q2 = load_rotated(q_first, cos, sin, q_mask, HALF)
        tl.store(q_first, q1, mask=q_mask)  # the store rounds to q's dtype
        tl.store(q_first + HALF, q2, mask=q_mask)
    dst = slot_offset(slot, BLOCK_SIZE, stride_cb, stride_cs) + heads * stride_ch
    store_kv_rows(
        k_ptr + token * stride_kt + heads * stride_kh,
        v_ptr + token * stride_vt + heads * stride_vh,
        k_cache_ptr + dst,
        v_cache_ptr + dst,
        heads < tl.where(slot >= 0, NUM_KV_HEADS, 0),  # no head of a slot -1 row
        cos,
        sin,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_HALF,
        ROTARY,
    )


def store_kv_triton(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; any token/head strides, last dim contiguous
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip
    rotary: Rotary | None = None,  # its q strided like k; cos/sin: last dim contiguous
) -> None:
    """Same function as `store_kv_ref`, in one launch of ``num_tokens`` programs and no host sync, so a
    CUDA graph can capture it (padding tokens carry slot -1). q, ``k`` and ``v`` may be views into one
    fused qkv projection (they must not overlap). The kernel rotates in float32 and rounds once."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    if rotary is not None:
        q, cos, sin = rotary
        assert q.shape[::2] == (num_tokens, head_dim) and q.stride(2) == 1 and head_dim % 2 == 0
        assert cos.shape == sin.shape == (num_tokens, head_dim // 2)
        assert cos.stride() == sin.stride() and cos.stride(1) == 1
    else:  # nothing reads q, cos or sin: k stands in for them
        q = cos = sin = k
    num_q_heads = q.shape[1]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_HALF=triton.next_power_of_2(max(head_dim // 2, 1)),
        ROTARY=rotary is not None,
        **launch_options(k.device),
    )
