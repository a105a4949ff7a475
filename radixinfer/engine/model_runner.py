"""Turns a planned batch (token ids, positions, slots, block tables) into one forward of the model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixinfer.attention import AttentionBackend, AttentionMetadata, ForwardContext
from radixinfer.cache.kv_store import KVStore
from radixinfer.models.base import PagedCausalLM


class ModelRunner:
    """Owns the model, the KV tensors and the attention backend. Host lists are turned into device tensors
    here, once per forward."""

    def __init__(self, model: PagedCausalLM, kv: KVStore, backend: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = device
        self.num_forwards = 0
        self.num_forward_tokens = 0

    def _tensor(self, values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
    ) -> torch.Tensor:
        """One ragged forward. Sequence ``b`` contributes ``query_lens[b]`` consecutive tokens ending at
        position ``context_lens[b] - 1``; ``slots`` has one entry per token (-1 = already stored).
        Returns the final hidden states ``[num_tokens, hidden_size]``."""
        width = max(len(t) for t in tables)
        padded = [list(t) + [0] * (width - len(t)) for t in tables]
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(padded, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            query_start_loc=self._tensor(query_start, torch.int32),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
        )
        ctx = ForwardContext(meta, self.kv.k, self.kv.v, self.backend)
        self.num_forwards += 1
        self.num_forward_tokens += len(input_ids)
        return self.model(self._tensor(input_ids), self._tensor(positions), ctx)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32: the output projection only."""
        return self.model.compute_logits(hidden)
