"""The PyTorch reference backend: the CPU path of the engine and the oracle the Triton backend is tested against."""

from __future__ import annotations

import torch

from kernels.paged_attention import paged_attention_ref
from kernels.store_kv import store_kv_ref
from radixinfer.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"
    reads_shared_prefixes_once = (
        False  # ignores AttentionMetadata.shared_prefix: same result, one gather
    )

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        store_kv_ref(k_cache, v_cache, k, v, slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention_ref(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_context_len,
            scale,
        )
