"""The PyTorch reference backend: the CPU path of the engine and the oracle the Triton backend is tested against."""

from __future__ import annotations

import numpy as np
import torch

from kernels.paged_attention import paged_attention_ref
from kernels.store_kv import store_kv_ref
from radixinfer.attention.backend import KernelBackend
from radixinfer.attention.shared_prefix import MIN_SHARED_LEN


class NothingToPlan:
    """The planner of a backend that reads no work list and no shared-prefix tiles: it plans
    nothing (see `AttentionPlanner`)."""

    seqs_per_tile = 0
    min_shared_len = MIN_SHARED_LEN  # the tiled backends' threshold: one worst-case step for all

    def extend_work_capacity(self, max_tokens: int, max_seqs: int) -> int:
        return 0

    def plan_extend_work(
        self, query_lens: np.ndarray, context_lens: np.ndarray, work: np.ndarray
    ) -> int:
        return 0

    def max_shared_prefix_tiles(self, num_seqs: int) -> int:
        return 0

    def plan_shared_prefixes(
        self,
        tables: np.ndarray,
        context_lens: np.ndarray,
        tile_seqs: np.ndarray,
        tile_lens: np.ndarray,
        kv_starts: np.ndarray,
    ) -> int:
        return 0


class TorchAttentionBackend(KernelBackend):
    """Gathers each sequence's context from its block table and attends in plain PyTorch; ignores
    `AttentionMetadata.shared_prefix` and `.extend_work` (same result, one gather)."""

    name = "torch"
    store = staticmethod(store_kv_ref)
    attention = staticmethod(paged_attention_ref)

    def planner(
        self, block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> NothingToPlan:
        return NothingToPlan()
