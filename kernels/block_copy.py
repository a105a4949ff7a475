"""Batched block copy for copy-on-write: every (src, dst) pair of a step, all layers, K and V."""

from __future__ import annotations

import torch


def copy_blocks_ref(
    k_cache: torch.Tensor,  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    src: torch.Tensor,  # [num_copies] int64
    dst: torch.Tensor,  # [num_copies] int64; distinct, and disjoint from src
) -> None:
    k_cache[:, dst] = k_cache[:, src]
    v_cache[:, dst] = v_cache[:, src]
