"""Batched block copy for copy-on-write: every (src, dst) pair of a step, all layers, K and V."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def copy_blocks_ref(
    k_cache: torch.Tensor,  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    src: torch.Tensor,  # [num_copies] int64
    dst: torch.Tensor,  # [num_copies] int64; distinct, and disjoint from src
) -> None:
    k_cache[:, dst] = k_cache[:, src]
    v_cache[:, dst] = v_cache[:, src]


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr,
    v_cache_ptr,
    src_ptr,
    dst_ptr,
    stride_layer,
    stride_block,  # shared by both pools; one block's elements are contiguous
    block_numel,  # block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
):
    """Program (pair, layer) copies one block of one layer, K and V, in CHUNK-element pieces."""
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = layer * stride_layer + tl.load(src_ptr + pair).to(tl.int64) * stride_block
    dst = layer * stride_layer + tl.load(dst_ptr + pair).to(tl.int64) * stride_block
    for start in range(0, block_numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < block_numel
        tl.store(k_cache_ptr + dst + offs, tl.load(k_cache_ptr + src + offs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst + offs, tl.load(v_cache_ptr + src + offs, mask=mask), mask=mask)


def copy_blocks_triton(
    k_cache: torch.Tensor,  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    src: torch.Tensor,  # [num_copies] int32/int64, on the pool's device, any stride
    dst: torch.Tensor,  # [num_copies]; distinct, and disjoint from src
) -> None:
    """Same function as `copy_blocks_ref` in one launch of ``num_copies x num_layers`` programs, no host sync.

    Because ``dst`` is disjoint from ``src`` no program reads what another writes, so the order of programs
    does not matter. Requires each block's ``[block_size, num_kv_heads, head_dim]`` to be contiguous.
    """
    num_copies = src.numel()
    if num_copies == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache[0, 0].is_contiguous()
    block_numel = k_cache[0, 0].numel()
    _copy_blocks_kernel[(num_copies, k_cache.shape[0])](
        k_cache,
        v_cache,
        src.contiguous(),
        dst.contiguous(),
        k_cache.stride(0),
        k_cache.stride(1),
        block_numel,
        CHUNK=min(triton.next_power_of_2(block_numel), 4096),
    )
