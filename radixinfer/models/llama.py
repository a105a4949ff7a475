"""The Llama family over the paged KV cache: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3.

They differ only in a few switches, read from the config:

    model_type   q/k/v bias            o_proj bias       q/k RMSNorm per head (before RoPE)
    llama        attention_bias        attention_bias    -
    mistral      -                     -                 -
    qwen2        always                -                 -
    qwen3        attention_bias        attention_bias    yes

Everything else is shared: GQA, RoPE, RMSNorm, SwiGLU MLP, optional tied embeddings. Layers are
sharded over a tensor-parallel group (`radixinfer.models.parallel`): q/k/v and gate/up by columns,
o_proj and down_proj by rows, the embedding and the output projection by vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from radixinfer.attention import ForwardContext
from radixinfer.distributed.group import TensorParallel
from radixinfer.models.base import AttentionLayer, PagedCausalLM
from radixinfer.models.layers import RMSNorm, linear_silu_and_mul
from radixinfer.models.parallel import (
    AttentionShards,
    ColumnParallelLinear,
    OutputShard,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from radixinfer.models.rotary import RotaryEmbedding


class LlamaAttention(AttentionLayer):
    """Attention over this rank's query heads and the KV heads they read (all of them with one
    rank); ``o_proj`` sums the ranks' outputs."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        shards: AttentionShards,
        tp: TensorParallel,
    ) -> None:
        super().__init__(layer_idx, shards, shards.head_dim**-0.5)
        attention_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            {"q": shards.q, "k": shards.kv, "v": shards.kv},
            bias=attention_bias or config.model_type == "qwen2",
        )
        self.o_proj = RowParallelLinear(
            shards.q.size, config.hidden_size, attention_bias, tp, "num_attention_heads"
        )
        has_qk_norm = config.model_type == "qwen3"
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if has_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if has_qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # rotary on q (in place) and k, fused into the KV store
        return self.o_proj(self.attend(q, k, v, ctx, cos, sin))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))`` with gate and up as one matmul; for SiLU (every model of the
    family) ``act * up`` is fused into it (`linear_silu_and_mul`), for any other activation two eager ops
    after it."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        half = OutputShard.split(config.intermediate_size, tp, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, {"gate": half, "up": half}, bias=bias
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias, tp, "intermediate_size"
        )
        self.act = None if config.hidden_act == "silu" else ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.act is None:
            proj = self.gate_up_proj
            return self.down_proj(linear_silu_and_mul(x, proj.weight, proj.bias))
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # [T, intermediate] each
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        shards: AttentionShards,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, shards, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried unsummed, vLLM-style, so each add fuses into the norm after it:
        ``h`` is the previous layer's MLP output (the embeddings for the first layer, with ``residual`` None)
        and ``residual`` the stream before it. Returns this layer's ``(mlp output, residual)`` likewise."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        shards: AttentionShards,
        max_positions: int,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(config, shards.head_dim, max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, shards, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # [T, head_dim // 2], gathered once for all layers
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, ctx)
        return self.norm(h, residual)[0]  # the last layer's residual add, fused


class LlamaForCausalLM(PagedCausalLM):
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__(config, tp)
        self.model = LlamaModel(config, self.attention_shards, self.max_context_len, tp)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)
