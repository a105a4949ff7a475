"""The attention backend interface and the per-forward context the model layers call into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radixinfer.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores new K/V into paged slots and computes attention of the new tokens over the cache.

    ``k_cache``/``v_cache`` are one layer's pages: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    ``reads_shared_prefixes_once``: whether `attend` uses ``meta.shared_prefix`` (else the runner need not
    plan it).
    """

    reads_shared_prefixes_once: bool

    def store_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


@dataclass(frozen=True)
class ForwardContext:
    """Everything an attention layer needs for one forward, built once per step (nano-vllm's pattern).

    ``k_cache``/``v_cache`` are the whole pool: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    meta: AttentionMetadata
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    backend: AttentionBackend

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store this layer's new K/V, then attend over the cache. Returns ``[num_tokens, num_heads, head_dim]``.

        Storing for the whole batch before attending is what lets a request read, in the same forward,
        prefix K/V that another request of the batch is computing (in-batch prefix sharing).
        """
        k_layer, v_layer = self.k_cache[layer], self.v_cache[layer]
        self.backend.store_kv(k_layer, v_layer, k, v, self.meta.slot_mapping)
        return self.backend.attend(q, k_layer, v_layer, self.meta, scale)
