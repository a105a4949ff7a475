"""The Triton backend: the engine's attention on CUDA (same function as the PyTorch reference backend).

CUDA-graph capture (decode): every launch here has a grid fixed by host ints and no host sync. For a
captured batch size keep fixed: ``num_tokens == num_seqs``, the block-table width and ``max_context_len``
(it picks the decode split count; capture with the largest context the graph will serve — correctness
never depends on it, only the split count does). Pad unused rows with slot -1 and context_len 0 (they
store nothing and attend to nothing). The decode workspace (``[num_seqs, num_heads, num_splits, head_dim]``
f32 when more than one split) is allocated per call, from the graph's pool when capturing.

CUDA-graph capture (prefill): the extend grid is the work list's capacity, so a captured token bucket keeps
fixed the token count, the sequence count (padding sequences have query length 0 and context length 0),
the block-table width and the work list's capacity (idle items past the plan); ``max_query_len`` must stay
above 1 (it only picks the extend kernel over the decode one).
"""

from __future__ import annotations

import torch

from kernels.paged_attention import paged_attention_triton
from kernels.store_kv import store_kv_triton
from radixinfer.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"
    reads_shared_prefixes_once = True  # honours AttentionMetadata.shared_prefix

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        store_kv_triton(k_cache, v_cache, k, v, slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The decode kernel when ``meta.is_decode`` (with ``meta.shared_prefix``'s tiles when set), the extend
        kernel over ``meta.extend_work`` otherwise."""
        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_context_len,
            scale,
            shared=meta.shared_prefix,
            extend_work=meta.extend_work,
        )
