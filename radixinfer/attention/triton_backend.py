"""The Triton backend: the engine's attention on CUDA (same function as the PyTorch reference backend).

CUDA-graph capture (decode): every launch here has a grid fixed by host ints and no host sync. For a
captured batch size keep fixed: ``num_tokens == num_seqs``, the block-table width and ``max_context_len``
(it picks the decode split count; capture with the largest context the graph will serve — correctness
never depends on it, only the split count does). Pad unused rows with slot -1 and context_len 0 (they
store nothing and attend to nothing). Without shared-prefix tiles the decode split kernel stores the new
K/V itself (`TritonAttentionBackend.store_and_attend`), under the same rules. The decode workspace
(``[num_seqs, num_heads, num_splits, head_dim]`` f32 when more than one split) is allocated per call,
from the graph's pool when capturing.

CUDA-graph capture (prefill): the extend grid is the work list's capacity, so a captured token bucket keeps
fixed the token count, the sequence count (padding sequences have query length 0 and context length 0),
the block-table width and the work list's capacity (idle items past the plan); ``max_query_len`` must stay
above 1 (it only picks the extend kernel over the decode one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kernels.paged_attention import (
    NewKV,
    extend_block_m,
    paged_attention_triton,
    paged_decode_attention_triton,
    plan_extend_work,
    shared_prefix_seqs_per_tile,
)
from kernels.store_kv import store_kv_triton
from radixinfer.attention.backend import KernelBackend
from radixinfer.attention.metadata import AttentionMetadata
from radixinfer.attention.shared_prefix import MIN_SHARED_LEN, SharedPrefixPlanner


class TritonAttentionPlanner:
    """The Triton kernels' host-side plans for one model's head layout and dtype (see
    `AttentionPlanner`): the extend kernel's work list, one item per ``BLOCK_M`` query rows of a
    sequence (`plan_extend_work`), and decode's shared-prefix tiles (`SharedPrefixPlanner`; none when
    one KV head's query heads alone fill a tile)."""

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype):
        self._block_m = extend_block_m(dtype)
        seqs_per_tile = shared_prefix_seqs_per_tile(num_heads, num_kv_heads, dtype)
        self.seqs_per_tile = seqs_per_tile if seqs_per_tile >= 2 else 0
        self.min_shared_len = MIN_SHARED_LEN
        self._tiles = (
            SharedPrefixPlanner(block_size, seqs_per_tile, MIN_SHARED_LEN)
            if self.seqs_per_tile
            else None
        )

    def extend_work_capacity(self, max_tokens: int, max_seqs: int) -> int:
        return -(-max_tokens // self._block_m) + max_seqs

    def plan_extend_work(
        self, query_lens: np.ndarray, context_lens: np.ndarray, work: np.ndarray
    ) -> int:
        return plan_extend_work(query_lens, context_lens, self._block_m, work)

    def max_shared_prefix_tiles(self, num_seqs: int) -> int:
        return self._tiles.max_tiles(num_seqs) if self._tiles is not None else 0

    def plan_shared_prefixes(
        self,
        tables: np.ndarray,
        context_lens: np.ndarray,
        tile_seqs: np.ndarray,
        tile_lens: np.ndarray,
        kv_starts: np.ndarray,
    ) -> int:
        if self._tiles is None:
            return 0
        return self._tiles.plan(tables, context_lens, tile_seqs, tile_lens, kv_starts)


class TritonAttentionBackend(KernelBackend):
    """Stores K/V and attends with the Triton kernels of `kernels/`; reads the planned extend work
    list and shared-prefix tiles."""

    name = "triton"
    store = staticmethod(store_kv_triton)
    attention = staticmethod(paged_attention_triton)

    def planner(
        self, block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> TritonAttentionPlanner:
        return TritonAttentionPlanner(block_size, num_heads, num_kv_heads, dtype)

    def attention_options(self, meta: AttentionMetadata) -> dict[str, Any]:
        """The decode kernel runs when ``meta.is_decode`` (with ``meta.shared_prefix``'s tiles when
        set), the extend kernel over ``meta.extend_work`` otherwise."""
        return {"shared": meta.shared_prefix, "extend_work": meta.extend_work}

    def store_and_attend(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """At a decode step without shared-prefix tiles, one launch fewer: the decode split kernel
        stores the new K/V (rotating q in registers, k on its way) before it attends (`NewKV`), which
        needs ``meta.new_slots_private``. Otherwise the store's launch, then attention: the
        shared-prefix tile kernel reads rotated q from memory and other sequences' positions, and a
        prefill token (the decode kernel's shape or not) may read new tokens of other sequences."""
        if not (meta.is_decode and meta.new_slots_private) or meta.shared_prefix is not None:
            return super().store_and_attend(k_cache, v_cache, q, k, v, meta, scale, cos, sin)
        return paged_decode_attention_triton(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.max_context_len,
            scale,
            new_kv=NewKV(k, v, meta.slot_mapping, cos, sin),
        )
