"""The model interface the engine depends on: a causal LM whose attention reads and writes the paged KV cache."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from radixinfer.attention import ForwardContext
from radixinfer.distributed.group import TensorParallel
from radixinfer.models.layers import LoadedTensor
from radixinfer.models.parallel import AttentionShards, ParallelLMHead, VocabParallelEmbedding


def attention_window(config: PretrainedConfig) -> int | None:
    """The sliding window a config's attention uses, or None for full attention everywhere.

    Mistral applies ``sliding_window`` whenever it is set; Qwen2/3 only on layers whose ``layer_types`` entry is
    ``sliding_attention`` (transformers 5) or when ``use_sliding_window`` is on (older configs).
    """
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


class AttentionLayer(nn.Module):
    """The part of a decoder layer's attention every model shares: which layer it is (its slice of
    the KV pool), this rank's head counts and head size, the softmax scale, and the step between
    the projections (`attend`). Subclasses build the projections around it."""

    def __init__(self, layer_idx: int, shards: AttentionShards, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = shards.num_heads, shards.num_kv_heads
        self.head_dim = shards.head_dim
        self.scale = scale

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this layer's new K/V and attend over the cache (`ForwardContext.attention`):
        ``q [T, num_heads, head_dim]``, ``k``, ``v [T, num_kv_heads, head_dim]`` ->
        ``[T, num_heads * head_dim]``, the heads side by side as the output projection reads them.
        With ``cos``/``sin`` ``[T, head_dim // 2]``, rotary embedding of q and k comes first, in
        the same launch as the store; q must not be read afterwards."""
        return ctx.attention(self.layer_idx, q, k, v, self.scale, cos, sin).flatten(1)


class PagedCausalLM(nn.Module):
    """A decoder-only LM over a ragged batch (all sequences' new tokens concatenated, no padding).

    Attention layers call ``ctx.attention(layer_idx, q, k, v, scale[, cos, sin])``, which applies
    rotary embedding when given cos/sin, stores the new K/V in the paged cache and attends over each
    sequence's cached prefix plus its new tokens; the model itself never sees block tables. The KV
    pool the engine allocates is ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V.

    Subclasses build their modules with the same names as the transformers checkpoint, except where fused
    (``stacked_params``) or renamed in an override of ``map_checkpoint_weight``.

    Under tensor parallelism (``tp.size`` > 1) the model holds this rank's shard of every layer:
    ``num_heads`` and ``num_kv_heads`` count this rank's heads (its KV pool holds those), while
    ``hidden_size`` and ``vocab_size`` are the whole model's (activations are replicated, logits
    gathered).
    """

    # checkpoint module name -> (fused module name, shard id), e.g. "q_proj" -> ("qkv_proj", "q")
    stacked_params: ClassVar[dict[str, tuple[str, str]]] = {}
    lm_head: ParallelLMHead  # set by subclasses through `make_lm_head`

    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.num_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        self.attention_shards = AttentionShards.of(config, tp)
        self.head_dim: int = self.attention_shards.head_dim
        self.num_heads: int = self.attention_shards.num_heads
        self.num_kv_heads: int = self.attention_shards.num_kv_heads
        self.vocab_size: int = config.vocab_size
        # only full attention is implemented: a sliding-window model is exact up to its window, so cap there
        window = attention_window(config)
        self.max_context_len: int = min(
            config.max_position_embeddings, window or config.max_position_embeddings
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` int64. Returns the final hidden states after the
        final norm, ``[num_tokens, hidden_size]`` in the model dtype."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The output projection alone: ``[n, hidden_size]`` -> ``[n, vocab_size]`` in the model
        dtype, written into ``out`` when given (a CUDA graph's shared output). Not cast to float32
        here: at batch 512 and a 152k vocabulary that cast moves ~0.5 GB per decode step, and greedy
        rows (argmax; the cast is monotonic) never need it; the sampler casts when a row samples."""
        return self.lm_head.logits(hidden, out)

    def make_lm_head(self, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        """The output projection; shares the embedding's weight (no allocation) when the config ties them."""
        if not self.config.tie_word_embeddings:
            return ParallelLMHead(self.vocab_size, self.hidden_size, self.tp)
        with torch.device("meta"):
            lm_head = ParallelLMHead(self.vocab_size, self.hidden_size, self.tp)
        lm_head.weight = embedding.weight
        return lm_head

    def map_checkpoint_weight(
        self, name: str, tensor: LoadedTensor
    ) -> tuple[str, LoadedTensor, str | None] | None:
        """Translate one checkpoint tensor into ``(parameter name, tensor, shard id)``; None skips it.

        Skipped: rotary ``inv_freq`` buffers some checkpoints carry, and ``lm_head.weight`` of a tied model
        (it is the embedding). Fused parameters get the shard id their weight loader expects.
        """
        if name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and self.config.tie_word_embeddings
        ):
            return None
        for part, (fused, shard_id) in self.stacked_params.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), tensor, shard_id
        return name, tensor, None
