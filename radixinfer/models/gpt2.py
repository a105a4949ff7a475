"""GPT-2 over the paged KV cache: learned positions, pre-LayerNorm blocks, GELU MLP, tied output projection.

Module names are the checkpoint's without the ``transformer.`` prefix. The checkpoint stores its
projections as ``Conv1D`` weights ``[in, out]``; they are transposed once at load into
``nn.Linear``'s ``[out, in]`` (the read of a rank's shard then takes columns of the stored tensor).
Sharded over a tensor-parallel group like the Llama family; the learned positions are replicated.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from radixinfer.attention import ForwardContext
from radixinfer.distributed.group import TensorParallel
from radixinfer.models.base import AttentionLayer, PagedCausalLM
from radixinfer.models.layers import LoadedTensor
from radixinfer.models.parallel import (
    AttentionShards,
    ColumnParallelLinear,
    OutputShard,
    RowParallelLinear,
    VocabParallelEmbedding,
)

_CONV1D_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2Attention(AttentionLayer):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        shards: AttentionShards,
        tp: TensorParallel,
    ) -> None:
        scale = shards.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        super().__init__(layer_idx, shards, scale)
        hidden = config.hidden_size
        # q, k, v: one tensor in the checkpoint, this rank's heads of each
        qkv = {"q": shards.q, "k": shards.q, "v": shards.q}
        self.c_attn = ColumnParallelLinear(hidden, qkv, bias=True, checkpoint_shards=False)
        self.c_proj = RowParallelLinear(hidden, hidden, True, tp, "num_attention_heads")

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        q, k, v = (
            self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        )  # 3 x [T, H, D]
        return self.c_proj(self.attend(q, k, v, ctx))


# GPT-2's "gelu_new" is the tanh approximation of GELU written as seven element-wise ops (seven launches per
# layer, ~0.5 ms of host time per eager prefill pass on an H200's host); torch computes the same function in
# one kernel (fp32: equal within 3e-7; fp16: both within 0.0073 of the fp32 value).
_ONE_KERNEL = {"gelu_new": "gelu_pytorch_tanh"}


class GPT2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        shard = {"fc": OutputShard.split(inner, tp, "MLP size (n_inner)")}
        self.c_fc = ColumnParallelLinear(
            config.hidden_size, shard, bias=True, checkpoint_shards=False
        )
        self.c_proj = RowParallelLinear(inner, config.hidden_size, True, tp, "MLP size (n_inner)")
        self.act = ACT2FN[_ONE_KERNEL.get(config.activation_function, config.activation_function)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        shards: AttentionShards,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx, shards, tp)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config, tp)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), ctx)
        return h + self.mlp(self.ln_2(h))


class GPT2LMHeadModel(PagedCausalLM):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__(config, tp)
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(
            GPT2Block(config, i, self.attention_shards, tp) for i in range(config.num_hidden_layers)
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = self.make_lm_head(self.wte)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        h = self.wte(input_ids) + self.wpe(positions)  # [T, hidden]
        for block in self.h:
            h = block(h, ctx)
        return self.ln_f(h)

    def map_checkpoint_weight(
        self, name: str, tensor: LoadedTensor
    ) -> tuple[str, LoadedTensor, str | None] | None:
        """Strip ``transformer.``, drop the causal-mask buffers old checkpoints carry, transpose Conv1D weights."""
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(_CONV1D_MODULES):
            tensor = tensor.t()
        return super().map_checkpoint_weight(name, tensor)
