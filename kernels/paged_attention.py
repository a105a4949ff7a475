"""Attention of a ragged batch of new tokens over the paged KV cache (decode and extend in one function).

Sequence ``b`` has ``query_len`` new tokens (rows ``query_start_loc[b]:query_start_loc[b+1]`` of ``q``) at
positions ``context_len - query_len ..``; token ``i`` attends to positions ``0 .. prefix_len + i``.

`paged_attention_ref` is the PyTorch reference. `paged_attention_triton` computes the same function with
one of two Triton kernels sharing one inner loop (`_attend_kv_range`, online softmax over KV tiles gathered
through the block table, one position at a time, so any ``block_size >= 1`` and prefixes ending mid-block
work):

- **decode** (every ``query_len == 1``): program (seq, kv_head, split) runs the ``num_heads // num_kv_heads``
  query heads of one KV head together as the rows of one tile, so each K/V tile is loaded once per group.
  Each sequence's context is cut into ``num_splits`` equal ranges (flash-decoding); a second launch merges
  the partial results by log-sum-exp. The grid depends only on host ints, never on ``context_lens``.
  Given the step's new K/V (`NewKV`; not with shared-prefix tiles) the split kernel also does the store
  step, so the store kernel (`kernels/store_kv.py`) does not run: each program rotates its q rows in
  registers, and the split whose range ends at the new position writes that KV head's new K (rotated)
  and V into the token's slot before it reads the range::

      positions  0 ........ chunk ........ 2*chunk ...... context_len
      split      |    0     |      1       |      2       |  3.. empty (lse = -inf)
                 chunk = ceil(context_len / num_splits) rounded up to BLOCK_N, per sequence, on device

- **shared-prefix decode** (cascade): when groups of sequences share the physical blocks of a prefix (the
  prefix cache makes them so), a third kernel attends every query row of a *tile* of up to
  ``seqs_per_tile`` such sequences to the shared positions ``[0, shared_len)`` at once, so each K/V tile of
  the prefix is loaded once per tile of sequences instead of once per sequence; the split kernel then covers
  only ``[kv_start, context_len)`` of each sequence, and the merge combines both by log-sum-exp::

      positions  0 ........................ shared_len ....... context_len
      seq a      |   tile kernel (rows of a, b, c ... together)  | split kernel, a alone  |
      seq b      |   (same blocks: one load serves every row)    | split kernel, b alone      |

- **extend** (prefill, hits and misses together): program (work item, head), a work item being one query
  tile of one sequence, planned on the host (`plan_extend_work`, heaviest tiles first) into a list whose
  length may be padded with idle items: so the grid depends on the token and sequence counts only, never on
  how the tokens split among the sequences, and one captured CUDA graph serves every batch of a size. KV
  positions below the tile's first query position need no causal mask (first pass), the rest are masked
  (second pass)::

      KV positions  0 ............ prefix_len ...... context_len
      query tile    rows at prefix_len + m_start .. prefix_len + m_start + BLOCK_M - 1
      pass 1        [0, full_end)   unmasked, full_end = BLOCK_N-aligned floor of prefix_len + m_start + 1
      pass 2        [full_end, min(context_len, prefix_len + m_start + BLOCK_M))   kv_pos <= q_pos

Scores are kept in log2 units (``scale * log2(e)`` folded in) so the softmax uses ``exp2``. Float32 inputs
use exact (``ieee``) dots; fp16/bf16 use the tensor cores with float32 accumulation. Any ``head_dim`` works
(tiles are padded to a power of 2 and masked).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.device import num_sms
from kernels.pdl import launch_options, let_next_kernel_start, wait_for_inputs
from kernels.rotary import load_cos_sin, load_rotated_rows
from kernels.store_kv import slot_offset, store_kv_rows


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_context_len: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Gathers each sequence's KV into a padded batch and runs masked SDPA in float32 (vectorized, no
    per-sequence loop). Memory is ``num_seqs * max_query_len * max_context_len`` scores per head: a
    reference and CPU path, not the fast one."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    device = q.device

    kv_pos = torch.arange(max_context_len, device=device)  # [C]
    blocks = block_tables[:, kv_pos // block_size].long()  # [B, C]
    slots = blocks * block_size + kv_pos % block_size  # [B, C]
    k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()  # [B, C, Hkv, D]
    v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()

    starts = query_start_loc[:-1].long()
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [B]
    q_off = torch.arange(max_query_len, device=device)  # [Q]
    rows = starts[:, None] + q_off[None, :]  # [B, Q]
    row_valid = q_off[None, :] < query_lens[:, None]  # [B, Q]
    q_pad = q[rows.clamp(max=num_tokens - 1)].float()  # [B, Q, H, D]

    prefix_lens = context_lens.long() - query_lens  # [B]
    q_pos = prefix_lens[:, None] + q_off[None, :]  # [B, Q]
    allowed = kv_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, C]; implies kv_pos < context_len
    allowed &= row_valid[:, :, None]
    allowed[:, :, 0] = True  # padded query rows: keep softmax finite; their output is dropped below

    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # [B, H, Q, D]
        k.transpose(1, 2),  # [B, Hkv, C, D]
        v.transpose(1, 2),
        attn_mask=allowed[:, None],  # [B, 1, Q, C]
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # [B, Q, H, D]
    result = torch.empty_like(q)
    result[rows[row_valid]] = out[row_valid].to(q.dtype)
    return result


# ----------------------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _attend_kv_range(
    acc,
    row_max,
    row_sum,  # running state: [M, BLOCK_D] f32, [M] f32 (log2 units), [M] f32
    q,  # [M, BLOCK_D] query rows (unscaled)
    row_limit,  # [M] int32; last KV position each row may see (inclusive), read only when MASKED
    k_head_ptr,
    v_head_ptr,  # cache pointers already offset to this KV head
    table_ptr,  # this sequence's block-table row
    lo,
    hi,  # KV positions [lo, hi) to visit; lo is BLOCK_N-aligned relative to the range start
    qk_scale,  # softmax scale * log2(e)
    stride_cb,
    stride_cs,
    MASKED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, row_max, row_sum) with the KV positions ``[lo, hi)``.

    Invariant: when MASKED is False every row may see every position of the range; when MASKED is True
    each row's first visited tile holds at least one position it may see (so row_max never stays -inf
    for a real row and no NaN appears).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [N]
        in_range = pos < hi
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        rows = (
            block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        )  # [N] element offsets of the K/V rows
        kv_mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_head_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        if MASKED:
            s = tl.where(pos[None, :] <= row_limit[:, None], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        p = tl.exp2(s - new_max[:, None])
        alpha = tl.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_head_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _attend_kv_span(
    q,  # [ROWS, BLOCK_D] query rows (unscaled)
    row_limit,  # [ROWS] int32; last KV position each row may see (inclusive), read in the tail
    k_cache_ptr,
    v_cache_ptr,  # the whole layer's cache: [num_blocks, block_size, num_kv_heads, head_dim]
    kv_head,
    block_tables_ptr,
    table_row,  # the block-table row of the sequence whose blocks hold the span
    lo,
    full_end,
    hi,  # [lo, full_end): every row sees every position; [full_end, hi): masked by row_limit
    qk_scale,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The online-softmax state ``(acc, row_max, row_sum)`` of ``q``'s rows over the KV positions
    ``[lo, hi)`` of KV head ``kv_head``, from an empty start: `_attend_kv_range` over the unmasked
    part (a whole number of KV tiles), then over the masked tail (at most a tile or a causal
    diagonal). The one loop shape, and its address setup, that every kernel here runs.

    Must hold: ``full_end - lo`` is a multiple of BLOCK_N, and `_attend_kv_range`'s invariant for
    each part. Speed: inlined into each kernel, as every Triton function a kernel calls, so the
    kernels compile to the same code as with this setup written out in each."""
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_ch
    v_head_ptr = v_cache_ptr + kv_head * stride_ch
    table_ptr = block_tables_ptr + table_row.to(tl.int64) * stride_bt
    acc, row_max, row_sum = _attend_kv_range(
        acc, row_max, row_sum, q, row_limit, k_head_ptr, v_head_ptr, table_ptr, lo, full_end,
        qk_scale, stride_cb, stride_cs,
        False, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION,
    )  # fmt: skip
    return _attend_kv_range(
        acc, row_max, row_sum, q, row_limit, k_head_ptr, v_head_ptr, table_ptr, full_end, hi,
        qk_scale, stride_cb, stride_cs,
        True, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def _partial_result(acc, row_max, row_sum):
    """A range's normalised output and its log-sum-exp (log2 units) for the merge; a row that saw no position
    (an empty split or chunk, a padded sequence) gives zeros and lse = -inf, so the merge skips it."""
    seen = row_sum > 0
    row_sum = tl.where(seen, row_sum, 1.0)
    return acc / row_sum[:, None], tl.where(seen, row_max + tl.log2(row_sum), float("-inf"))


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    kv_starts_ptr,  # [num_seqs] int32: first position this kernel covers (read only with SHARED_CHUNKS)
    part_out_ptr,  # [num_seqs, num_heads, num_slots, head_dim]; f32 workspace, or the output if 1 split
    part_lse_ptr,  # [num_seqs, num_heads, num_slots] f32, contiguous
    k_ptr,  # the new tokens' k and v, [num_seqs, num_kv_heads, head_dim] (read only with STORE_KV)
    v_ptr,
    cos_ptr,  # [num_seqs, head_dim // 2] (read only with ROTARY)
    sin_ptr,
    slot_mapping_ptr,  # [num_seqs] int64; -1 = store nothing (read only with STORE_KV)
    qk_scale,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SHARED_CHUNKS: tl.constexpr,  # 0: no shared-prefix tiles; else the tile kernel's chunks per prefix
    STORE_KV: tl.constexpr,  # store each sequence's new K/V first (the store step's work, fused)
    ROTARY: tl.constexpr,  # rotate q (in registers) and k (on its way to the cache) first
    USE_PDL: tl.constexpr,
):
    """Program (seq, kv_head, split): partial ``split`` of ``[kv_start, context_len)``. With shared-prefix
    tiles the partials have SHARED_CHUNKS slots more (after the splits), the tile kernel's; split 0 of a
    sequence that no tile covers (kv_start 0) marks those slots empty (lse = -inf).

    With STORE_KV (never with SHARED_CHUNKS: the tile kernel reads the other sequences' rows of q and
    the positions this kernel would store) the store step happens here: every program rotates its q
    rows with ROTARY, and the one split whose range ends at the new position ``context_len - 1``
    writes its KV head's new K and V into slot ``slot_mapping[seq]`` (`store_kv_rows`, as the store
    kernel does), then reads them back from the cache as any other position. No other program reads
    that position: at decode no sequence's context holds another's new slot (slots are write-once),
    so a barrier within the program is the only ordering needed. A sequence with context_len 0
    (padding) has no such split and stores nothing."""
    let_next_kernel_start(USE_PDL)
    # before any load, and before the store (which could land under the previous kernel's readers)
    wait_for_inputs(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = 0
    num_slots = num_splits
    if SHARED_CHUNKS:
        start = tl.load(kv_starts_ptr + seq)
        num_slots = num_splits + SHARED_CHUNKS
    chunk = tl.cdiv(tl.cdiv(context_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, context_len)
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # [G]
    q_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    q_rows = q_ptr + seq * stride_qt + heads[:, None] * stride_qh  # [G, 1]
    cos_row = cos_ptr + seq * stride_ct
    sin_row = sin_ptr + seq * stride_ct
    if ROTARY:  # rounded to q's dtype, as the store kernel's store of q rounds it
        q = load_rotated_rows(q_rows, cos_row, sin_row, q_mask, HEAD_DIM // 2, BLOCK_D)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    if STORE_KV:
        if (hi > lo) & (hi == context_len):  # the split that holds the new position
            slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
            dst = slot_offset(slot, BLOCK_SIZE, stride_cb, stride_cs) + kv_head * stride_ch
            cos, sin = None, None  # read only with ROTARY
            if ROTARY:
                cos, sin = load_cos_sin(cos_row, sin_row, HEAD_DIM // 2, BLOCK_HALF)
            store_kv_rows(
                k_ptr + seq * stride_kt + kv_head * stride_kh,
                v_ptr + seq * stride_vt + kv_head * stride_vh,
                k_cache_ptr + dst,
                v_cache_ptr + dst,
                tl.zeros([1, 1], tl.int64) + slot >= 0,  # a [1, 1] mask; slot -1 stores nothing
                cos,
                sin,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_HALF,
                ROTARY,
            )
            # every thread of the program reads the new position below: CUDA makes a block's global
            # writes before a barrier visible to the whole block after it
            tl.debug_barrier()

    row_limit = tl.zeros([BLOCK_G], tl.int32) + hi - 1  # decode's only mask: the range's tail
    acc, row_max, row_sum = _attend_kv_span(
        q, row_limit, k_cache_ptr, v_cache_ptr, kv_head, block_tables_ptr, seq, lo, full_end, hi,
        qk_scale, stride_cb, stride_cs, stride_ch, stride_bt,
        BLOCK_G, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION,
    )  # fmt: skip

    out, lse = _partial_result(acc, row_max, row_sum)
    part = seq * stride_pt + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
    tl.store(part_out_ptr + part, out, mask=q_mask)
    lse_row = (seq * tl.num_programs(1) * GROUP + heads) * num_slots  # [G]
    tl.store(part_lse_ptr + lse_row + split, lse, mask=offs_g < GROUP)
    if SHARED_CHUNKS:
        if (split == 0) & (start == 0):
            empty = tl.full([BLOCK_G, SHARED_CHUNKS], float("-inf"), tl.float32)
            chunks = num_splits + tl.arange(0, SHARED_CHUNKS)
            tl.store(
                part_lse_ptr + lse_row[:, None] + chunks[None, :],
                empty,
                mask=(offs_g < GROUP)[:, None],
            )


@triton.jit
def _shared_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    tile_seqs_ptr,  # [num_tiles, SEQS_PER_TILE] int32: the sequences of each tile, -1 = none
    tile_lens_ptr,  # [num_tiles] int32: positions [0, len) every sequence of the tile shares; 0 = idle tile
    part_out_ptr,  # [num_seqs, num_heads, num_slots, head_dim] f32: writes the last SHARED_CHUNKS slots
    part_lse_ptr,  # [num_seqs, num_heads, num_slots] f32, contiguous
    qk_scale,
    num_slots,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    SEQS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SHARED_CHUNKS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
):
    """Program (tile, kv_head, chunk): row ``r`` is query head ``r % GROUP`` of the KV head's group in the
    tile's sequence ``r // GROUP``; all rows see all of the chunk's part of ``[0, len)``, read through the
    first sequence's block table (the caller guarantees every sequence of the tile has the same blocks
    there). A prefix is cut into SHARED_CHUNKS chunks of at least MIN_CHUNK positions, so a few tiles still
    fill the GPU; an empty chunk writes lse = -inf."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk_id = tl.program_id(2)
    shared_len = tl.load(tile_lens_ptr + tile)
    if shared_len == 0:
        return
    chunk = tl.maximum(tl.cdiv(tl.cdiv(shared_len, SHARED_CHUNKS), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    lo = chunk_id * chunk
    hi = tl.minimum(lo + chunk, shared_len)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    member = offs_m // GROUP
    seq = tl.load(
        tile_seqs_ptr + tile * SEQS_PER_TILE + member, mask=member < SEQS_PER_TILE, other=-1
    )
    valid = seq >= 0  # [M]
    seq = tl.maximum(seq, 0).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP  # [M]
    row_mask = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + seq[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )

    row_limit = tl.zeros([BLOCK_M], tl.int32) + hi - 1
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    first_seq = tl.load(tile_seqs_ptr + tile * SEQS_PER_TILE)  # its block table serves the tile
    acc, row_max, row_sum = _attend_kv_span(
        q, row_limit, k_cache_ptr, v_cache_ptr, kv_head, block_tables_ptr, first_seq,
        lo, full_end, hi, qk_scale, stride_cb, stride_cs, stride_ch, stride_bt,
        BLOCK_M, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION,
    )  # fmt: skip
    slot = num_slots - SHARED_CHUNKS + chunk_id
    out, lse = _partial_result(acc, row_max, row_sum)
    tl.store(
        part_out_ptr
        + seq[:, None] * stride_pt
        + heads[:, None] * stride_ph
        + slot * stride_ps
        + offs_d[None, :],
        out,
        mask=row_mask,
    )
    tl.store(part_lse_ptr + (seq * NUM_HEADS + heads) * num_slots + slot, lse, mask=valid)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_slots, head_dim] f32, contiguous
    part_lse_ptr,  # [num_seqs, num_heads, num_slots] f32, contiguous
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_slots,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (seq, head block): for each of BLOCK_H heads, out = sum_s 2^(lse_s - max) * out_s /
    sum_s 2^(lse_s - max) over the ``num_slots`` partials (the splits, and the shared-prefix chunks when there
    are some). A slot with lse = -inf is empty and its partial is not read (the shared-prefix slots of an
    uncovered sequence are never written). Heads go together because one (seq, head) is only a few hundred
    bytes: a program each made the merge cost more than the attention it merges."""
    let_next_kernel_start(USE_PDL)
    wait_for_inputs(USE_PDL)
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [H, 1]
    slots = tl.arange(0, BLOCK_S)[None, :]  # [1, S]
    dims = tl.arange(0, BLOCK_D)[None, None, :]  # [1, 1, D]
    rows = seq * NUM_HEADS + heads  # [H, 1]
    lse_mask = (heads < NUM_HEADS) & (slots < num_slots)
    lse = tl.load(
        part_lse_ptr + rows * num_slots + slots, mask=lse_mask, other=float("-inf")
    )  # [H, S]
    top = tl.max(lse, 1)  # [H]
    weight = tl.exp2(
        lse - tl.where(top == float("-inf"), 0.0, top)[:, None]
    )  # [H, S]; all 0 for context_len 0
    part_mask = (lse_mask & (lse > float("-inf")))[:, :, None] & (dims < HEAD_DIM)
    parts = tl.load(
        part_out_ptr + ((rows * num_slots + slots) * HEAD_DIM)[:, :, None] + dims,
        mask=part_mask,
        other=0.0,
    )  # [H, S, D]
    total = tl.sum(weight, 1)  # [H]
    out = tl.sum(parts * weight[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]  # [H, D]
    out_dims = tl.arange(0, BLOCK_D)[None, :]
    tl.store(
        out_ptr + seq * stride_ot + heads * stride_oh + out_dims,
        out,
        mask=(heads < NUM_HEADS) & (out_dims < HEAD_DIM),
    )


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    work_ptr,  # [2, num_items] int32: (sequence, query tile) per item; tile -1 = idle
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_work,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(
        0
    )  # fastest: the query heads of one KV head run together and share its K/V in L2
    item = tl.program_id(1)
    tile = tl.load(work_ptr + stride_work + item)
    if tile < 0:  # padding of a list planned for fewer tiles than the grid holds
        return
    seq = tl.load(work_ptr + item)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m_start = tile * BLOCK_M
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - query_len

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (q_start + offs_m).to(tl.int64)
    row_mask = (offs_m[:, None] < query_len) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )

    row_limit = prefix_len + offs_m  # causal: query m sits at position prefix_len + m
    full_end = (prefix_len + m_start + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(context_len, prefix_len + m_start + BLOCK_M)
    acc, row_max, row_sum = _attend_kv_span(
        q, row_limit, k_cache_ptr, v_cache_ptr, head // GROUP, block_tables_ptr, seq, 0, full_end,
        hi, qk_scale, stride_cb, stride_cs, stride_ch, stride_bt,
        BLOCK_M, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION,
    )  # fmt: skip
    out = acc / row_sum[:, None]  # padded rows (not stored) may divide by 0
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out, mask=row_mask
    )


# ----------------------------------------------------------------------------------------------------------
# Launchers

MIN_TOKENS_PER_SPLIT = (
    64  # one or two KV tiles: below this a split's fixed cost (q load, partial write) dominates
)
MAX_SPLITS = 128  # bounds the workspace: [num_seqs, num_heads, num_splits, head_dim] f32
# A shared prefix is read in up to this many chunks (programs) per tile and KV head (`shared_prefix_chunks`),
# each of at least MIN_SHARED_CHUNK positions (a multiple of every BLOCK_N).
MAX_SHARED_PREFIX_CHUNKS = 4
MIN_SHARED_CHUNK = 128
# The tile kernel's chunks stop doubling once its grid has this many programs per SM.
SHARED_PREFIX_PROGRAMS_PER_SM = 2
MERGE_TILE_ELEMENTS = (
    8192  # float32 partial values one merge program holds: 64 per thread at 4 warps
)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """How many programs share one sequence's context: up to four programs per SM in all, no more than one
    per ``MIN_TOKENS_PER_SPLIT`` positions of the longest context. Rounding down matters: once
    ``num_seqs * num_kv_heads`` alone gives about four programs per SM, a second split costs more (partials,
    merge) than it brings (measured on an H200, benchmarks/history/RESULTS-2026-11.md). A function of host
    ints only: the same batch size and length bound give the same grid."""
    by_occupancy = 4 * num_sms(device) // (num_seqs * num_kv_heads)
    by_length = triton.cdiv(max_context_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def shared_prefix_chunks(num_seqs: int, seqs_per_tile: int, num_kv_heads: int, sms: int) -> int:
    """How many chunks the tile kernel cuts each tile's shared prefix into: the fewest of 1, 2 and 4 that give
    the batch's full tiles (``num_seqs // seqs_per_tile``, what a batch of large groups fills) two programs
    per SM with their KV heads, or 4.

    Chunks buy parallelism, and each costs a float32 partial result per sequence and head that the merge
    reads back. Measured on an H200 (``benchmarks/sweep_decode_attention.py --shared-tiles``, a step's
    attention, 1 / 2 / 4 chunks; the rule's choice marked):

    - qwen2.5-0.5b (2 KV heads, 9 sequences a tile), 256 / 512 sequences sharing 1,024 positions in 8 / 16
      groups: 681 / 512 / **404** and 974 / 838 / **770** us; 1,024 in 64 groups sharing 2,048: 2,322 /
      **1,876** / 1,989 us;
    - llama-3.1-8b (8 KV heads, 16 a tile), 1,024 positions shared by 256 / 512 / 1,024 sequences in 8 / 16 /
      64 groups: 3,045 / 2,742 / **2,905**, 4,917 / **5,179** / 5,549 and **9,842** / 10,440 / 11,242 us.

    Four chunks were the rule before; the two shapes where the rule is not the best are no slower than that.
    A function of host ints only: the same batch size gives the same grid, so a captured graph serves every
    step."""
    programs = num_seqs // max(seqs_per_tile, 1) * num_kv_heads
    chunks = 1
    while (
        chunks < MAX_SHARED_PREFIX_CHUNKS
        and programs * chunks < SHARED_PREFIX_PROGRAMS_PER_SM * sms
    ):
        chunks *= 2
    return chunks


def _check_layouts(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
):
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert block_tables.stride(1) == 1
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored by Triton for 16-bit inputs


def _decode_config(block_d: int, dtype: torch.dtype) -> dict:
    """Tile and launch shape of the decode kernel. Swept on an H200
    (`benchmarks/sweep_decode_attention.py`; benchmarks/history/RESULTS-2026-11.md, "Decode kernel
    shape"): 64-position tiles on two warps read batch 512's short tails and whole contexts 10% and
    17% faster than 128 on four (the step runs ~1,000 programs of one or two tiles each: smaller
    programs keep more of them in flight), and are within 3% at batches 1 to 256 and head_dim
    128."""
    if (
        dtype == torch.float32
    ):  # exact fp32 dots run on CUDA cores: small tiles avoid register spills
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64, num_warps=2, num_stages=2)


def _extend_config(dtype: torch.dtype) -> dict:
    """Tile and launch shape of the extend kernel (swept on an H200 for head_dim 64 and 128: one warpgroup
    on 64 query rows was best or within 3%); fp32 (a correctness path) gets small tiles, as in decode."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def extend_block_m(dtype: torch.dtype) -> int:
    """Query rows per extend work item (`plan_extend_work` needs it on the host)."""
    return _extend_config(dtype)["BLOCK_M"]


def plan_extend_work(
    query_lens: np.ndarray, context_lens: np.ndarray, block_m: int, out: np.ndarray
) -> int:
    """Write the extend kernel's work items into ``out`` ``[2, capacity]`` (row 0 the sequence, row 1 the
    query tile) and mark the rest idle (tile -1). Returns how many items there are.

    One item per ``block_m`` query rows of a sequence, so at most ``num_tokens // block_m + num_seqs``.
    Ordered by the KV span they read, longest first: causal tiles differ in work by up to the whole context,
    and starting the long ones first keeps the SMs busy to the end."""
    tiles_per_seq = -(-query_lens // block_m)
    num_items = int(tiles_per_seq.sum())
    if num_items > out.shape[1]:
        raise ValueError(f"{num_items} extend work items exceed the capacity of {out.shape[1]}")
    seqs = np.repeat(np.arange(len(query_lens)), tiles_per_seq)
    tiles = np.arange(num_items) - np.repeat(
        np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq
    )
    span = (context_lens - query_lens)[seqs] + tiles * block_m
    order = np.argsort(-span, kind="stable")
    out[0, :num_items] = seqs[order]
    out[1, :num_items] = tiles[order]
    out[1, num_items:] = -1
    return num_items


def _shared_prefix_config(dtype: torch.dtype) -> dict:
    """Tile and launch shape of the shared-prefix kernel: the extend kernel's (rows of many sequences are
    query rows that see the same positions), fp32 small again."""
    return _extend_config(dtype)


def shared_prefix_seqs_per_tile(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> int:
    """How many sequences one shared-prefix tile holds: as many as fit their query heads of one KV head into
    the kernel's ``BLOCK_M`` rows (0: a KV head's group alone is too wide, no shared-prefix path)."""
    return _shared_prefix_config(dtype)["BLOCK_M"] // (num_heads // num_kv_heads)


class SharedPrefixTiles(NamedTuple):
    """Decode sequences grouped by a prefix whose blocks they share (built on the host by
    `radixinfer.attention.shared_prefix`). Invariants: the sequences of tile ``t`` hold the same block ids
    for positions ``[0, lens[t])`` and ``lens[t] < context_len`` for each of them; ``kv_starts[s]`` is the
    ``lens`` of the tile holding ``s``, 0 when none does; a sequence is in at most one tile."""

    seqs: torch.Tensor  # [num_tiles, seqs_per_tile] int32, contiguous; -1 = no sequence
    lens: torch.Tensor  # [num_tiles] int32; 0 = idle tile (its programs exit at once)
    kv_starts: torch.Tensor  # [num_seqs] int32


class NewKV(NamedTuple):
    """A decode step's new K/V, for the split kernel to store before it attends (`store_kv_triton`'s
    arguments, q aside): row ``b`` is sequence ``b``'s one new token, at position ``context_len - 1``.
    Given ``cos``/``sin``, q and k are rotated first: q in registers (q in memory is left as it is),
    k on its way into the cache. ``k`` and ``v`` are only read; q, k and v may be views into one fused
    qkv projection."""

    # [num_seqs, num_kv_heads, head_dim]; any token/head strides, last dim contiguous
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor  # [num_seqs] int64; -1 = store nothing
    # [num_seqs, head_dim // 2], last dim contiguous; None: no rotary
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def paged_decode_attention_triton(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32; 0 is allowed (CUDA-graph padding) and gives zeros
    max_context_len: int,  # an upper bound of context_lens; only picks num_splits
    scale: float,
    num_splits: int | None = None,  # None: decode_num_splits(...)
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]; allocated when None
    shared: SharedPrefixTiles
    | None = None,  # read each tile's shared prefix once for all its sequences
    shared_chunks: int | None = None,  # 1, 2 or 4; None: shared_prefix_chunks(...)
    new_kv: NewKV | None = None,  # stored (and rotated) by the split kernel; not with ``shared``
) -> torch.Tensor:
    """Flash-decoding over the paged cache. No host sync and a grid fixed by (num_seqs, num_kv_heads,
    num_splits) and the number of shared-prefix tiles, so it is CUDA-graph capturable; results do not
    depend on num_splits, ``shared`` or ``shared_chunks`` beyond rounding.

    Given ``new_kv``, computes what `store_kv_triton` then this function compute (the same float32
    operations and roundings), in one launch fewer, except that q in memory is left unrotated. Must
    hold then: no sequence's context holds another sequence's new slot (the engine's decode steps
    write each new token into a slot nobody else reads), as each sequence's store is ordered before
    its own reads only."""
    _check_layouts(q, k_cache, v_cache, block_tables)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    store_kv = new_kv is not None
    if store_kv:
        assert shared is None, "the tile kernel reads q and the cache: store in a launch of its own"
        k, v, slot_mapping, cos, sin = new_kv
        assert k.shape == v.shape == (num_seqs, num_kv_heads, head_dim)
        assert k.stride(2) == 1 and v.stride(2) == 1 and slot_mapping.shape == (num_seqs,)
    else:  # nothing reads them: q and context_lens stand in
        k, v, slot_mapping, cos, sin = q, q, context_lens, None, None
    rotary = cos is not None
    if rotary:
        assert head_dim % 2 == 0 and cos.shape == sin.shape == (num_seqs, head_dim // 2)
        assert cos.stride() == sin.stride() and cos.stride(1) == 1
    else:  # nothing reads cos or sin: q stands in for them
        cos = sin = q
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context_len, q.device)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    qk_scale = scale * math.log2(math.e)
    if shared is None:
        shared_chunks = 0
    elif shared_chunks is None:
        shared_chunks = shared_prefix_chunks(
            num_seqs, shared.seqs.shape[1], num_kv_heads, num_sms(q.device)
        )
    # a power of two, for the split kernel's tl.arange over the chunks' slots
    assert shared_chunks in (0, 1, 2, 4), shared_chunks
    num_slots = num_splits + shared_chunks

    # One partial is already the answer: write it straight to `out` and skip the merge.
    parts = (
        out.unsqueeze(2)
        if num_slots == 1
        else torch.empty(
            (num_seqs, num_heads, num_slots, head_dim), dtype=torch.float32, device=q.device
        )
    )
    lse = torch.empty((num_seqs, num_heads, num_slots), dtype=torch.float32, device=q.device)
    # The tile kernel and the split kernel write disjoint slots: on CUDA they run side by side (the tile
    # kernel on a second stream, joined before the merge; a captured graph keeps the two branches), so the
    # few hundred short programs of each fill the SMs together instead of each kernel's tail idling them.
    side = _side_stream(q.device) if shared is not None and q.is_cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(q.device))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens.contiguous(),
        context_lens if shared is None else shared.kv_starts,
        parts,
        lse,
        k,
        v,
        cos,
        sin,
        slot_mapping.contiguous(),
        qk_scale,
        num_splits,
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
        block_tables.stride(0),
        parts.stride(0),
        parts.stride(1),
        parts.stride(2),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_HALF=triton.next_power_of_2(max(head_dim // 2, 1)),
        DOT_PRECISION=_dot_precision(q.dtype),
        SHARED_CHUNKS=shared_chunks,
        STORE_KV=store_kv,
        ROTARY=rotary,
        **_decode_config(block_d, q.dtype),
        **launch_options(q.device),
    )
    if shared is not None:
        num_tiles, seqs_per_tile = shared.seqs.shape
        config = _shared_prefix_config(q.dtype)
        assert shared.seqs.is_contiguous() and 0 < seqs_per_tile * group <= config["BLOCK_M"]
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _shared_prefix_kernel[(num_tiles, num_kv_heads, shared_chunks)](
                q,
                k_cache,
                v_cache,
                block_tables,
                shared.seqs,
                shared.lens,
                parts,
                lse,
                qk_scale,
                num_slots,
                q.stride(0),
                q.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                block_tables.stride(0),
                parts.stride(0),
                parts.stride(1),
                parts.stride(2),
                GROUP=group,
                NUM_HEADS=num_heads,
                SEQS_PER_TILE=seqs_per_tile,
                BLOCK_SIZE=block_size,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                DOT_PRECISION=_dot_precision(q.dtype),
                SHARED_CHUNKS=shared_chunks,
                MIN_CHUNK=MIN_SHARED_CHUNK,
                **config,
            )
        if side is not None:
            torch.cuda.current_stream(q.device).wait_stream(side)
    if num_slots > 1:
        block_s = triton.next_power_of_2(num_slots)
        block_h = min(
            triton.next_power_of_2(num_heads), max(1, MERGE_TILE_ELEMENTS // (block_s * block_d))
        )
        _decode_merge_kernel[(num_seqs, triton.cdiv(num_heads, block_h))](
            parts,
            lse,
            out,
            num_slots,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=block_h,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
            # not after the tile kernel's stream joins: a programmatic edge is one kernel after another
            **(launch_options(q.device) if side is None else {"USE_PDL": False}),
        )
    return out


def extend_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    work: torch.Tensor,  # [2, num_items] int32, from `plan_extend_work`
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; allocated when None
) -> torch.Tensor:
    """Ragged prefill over a cached paged prefix, one launch for the whole batch (any query lengths,
    prefix lengths 0 included). The grid is the work list's length; idle items exit at once."""
    _check_layouts(q, k_cache, v_cache, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    config = _extend_config(q.dtype)
    assert work.stride(1) == 1 and work.shape[1] < 65536, (
        "a grid's second dimension holds 65,535 items"
    )
    _extend_kernel[(num_heads, work.shape[1])](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens.contiguous(),
        query_start_loc.contiguous(),
        work,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        work.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype),
        **config,
    )
    return out


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_context_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    shared: SharedPrefixTiles | None = None,  # decode only
    extend_work: torch.Tensor
    | None = None,  # extend only: [2, num_items] int32 from `plan_extend_work`
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same function as `paged_attention_ref`: the decode kernel when every sequence has one new token
    (then row b of ``q`` is sequence b), the extend kernel otherwise."""
    if max_query_len == 1:
        return paged_decode_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            max_context_len,
            scale,
            out=out,
            shared=shared,
        )
    assert shared is None, "shared-prefix tiles are a decode-only layout"
    assert extend_work is not None, "the extend kernel needs its work list (plan_extend_work)"
    return extend_attention_triton(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        extend_work,
        scale,
        out=out,
    )
