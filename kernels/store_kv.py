"""Store the new tokens' K/V into their paged slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_kv_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip (already stored / padding)
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,  # k, v: [num_tokens, num_kv_heads, head_dim], last stride 1
    stride_cb,
    stride_cs,
    stride_ch,  # both caches: [num_blocks, block_size, num_kv_heads, head_dim]
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: all heads of its K and V row into one slot; slot -1 does nothing."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + heads * stride_ch
        + dims
    )
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)  # the store casts to the cache dtype
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_triton(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; any token/head strides, last dim contiguous
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip
) -> None:
    """Same function as `store_kv_ref`, in one launch of ``num_tokens`` programs and no host sync, so a
    CUDA graph can capture it (padding tokens carry slot -1). ``k``/``v`` may be views into a fused qkv."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
