"""Attention of a ragged batch of new tokens over the paged KV cache (decode and extend in one function).

Sequence ``b`` has ``query_len`` new tokens (rows ``query_start_loc[b]:query_start_loc[b+1]`` of ``q``) at
positions ``context_len - query_len ..``; token ``i`` attends to positions ``0 .. prefix_len + i``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
