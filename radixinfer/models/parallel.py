"""Layers sharded over a tensor-parallel group (Megatron's split), and how each loads its shard.

    column-parallel   rank r holds rows of W (output features): y_r = x W_r^T, no communication;
                      q/k/v by heads, gate/up by halves of the intermediate size
    row-parallel      rank r holds columns of W (input features) matching a column-parallel
                      output: y = all_reduce(x_r W_r^T) + b (o_proj, down_proj, GPT-2's c_proj)
    vocab-parallel    rank r holds rows [r * n, (r + 1) * n) of the embedding (n = vocab / size,
                      rounded up; the last shard zero-padded): lookups are summed over the ranks,
                      and the output projection all-gathers every rank's logits

So a decoder layer makes two all-reduces, one after attention and one after the MLP; everything
between them (norms, rotary, the residual stream) is replicated. KV heads are split like query
heads; when there are fewer KV heads than ranks each is replicated on ``size / num_kv_heads``
ranks, the ones whose query heads read it.

Each weight loader reads only its rank's part of a checkpoint tensor (`CheckpointTensor.narrow`).
Called with ``shard_id`` None, a loader takes the unsharded parameter's layout (a fused layer's
projections concatenated), which is how random weights reach every rank identically
(`radixinfer.models.loader.init_random_weights`). With ``size`` 1 every layer computes what the
unsharded layer computes, op for op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from radixinfer.distributed.group import TensorParallel
from radixinfer.models.layers import LoadedTensor, copy_checked, linear, read_whole


@dataclass(frozen=True)
class OutputShard:
    """One projection's rows in a column-parallel layer: the unsharded projection has ``size``
    rows, of which this rank holds ``local_size`` starting at ``start``."""

    size: int
    local_size: int
    start: int

    @classmethod
    def split(cls, size: int, tp: TensorParallel, what: str = "size") -> OutputShard:
        """An even split of ``size`` rows (``what`` names them in the error when it is uneven)."""
        if size % tp.size:
            raise ValueError(
                f"tensor_parallel_size={tp.size} must divide the model's {what} ({size})"
            )
        local = size // tp.size
        return cls(size, local, tp.rank * local)

    @classmethod
    def heads(cls, num_heads: int, head_dim: int, tp: TensorParallel, what: str) -> OutputShard:
        """Whole heads per rank; fewer heads than ranks: one head each, replicated on
        ``size / num_heads`` consecutive ranks (which must be whole)."""
        if num_heads >= tp.size:
            if num_heads % tp.size:
                raise ValueError(f"tensor_parallel_size={tp.size} must divide {what} ({num_heads})")
            local = num_heads // tp.size
            return cls(num_heads * head_dim, local * head_dim, tp.rank * local * head_dim)
        if tp.size % num_heads:
            raise ValueError(
                f"{what} ({num_heads}) must divide tensor_parallel_size={tp.size} when smaller"
            )
        replicas = tp.size // num_heads
        return cls(num_heads * head_dim, head_dim, (tp.rank // replicas) * head_dim)


@dataclass(frozen=True)
class AttentionShards:
    """This rank's query and KV heads of a config's attention (every head with one rank)."""

    head_dim: int
    q: OutputShard
    kv: OutputShard

    @classmethod
    def of(cls, config: PretrainedConfig, tp: TensorParallel) -> AttentionShards:
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            head_dim,
            OutputShard.heads(num_heads, head_dim, tp, "num_attention_heads"),
            OutputShard.heads(num_kv_heads, head_dim, tp, "num_key_value_heads"),
        )

    @property
    def num_heads(self) -> int:  # this rank's query heads
        return self.q.local_size // self.head_dim

    @property
    def num_kv_heads(self) -> int:  # this rank's KV heads
        return self.kv.local_size // self.head_dim


def _check_size(loaded: LoadedTensor, dim: int, size: int, what: str) -> None:
    if loaded.shape[dim] != size:
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, expected {size} "
            f"along dimension {dim}"
        )


class ColumnParallelLinear(nn.Module):
    """Projections of the same input, this rank's rows of each, as one matmul: the output is the
    shards' local rows concatenated in ``shards`` order (q, k, v; gate, up), so fusing happens here
    and nowhere else.

    ``checkpoint_shards``: the checkpoint stores each shard as its own tensor, loaded with its
    shard id (``q_proj``, ``k_proj``, ...); False: one tensor holds them all, concatenated
    (GPT-2's ``c_attn``, or a single projection), loaded with shard id None.
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str, OutputShard],
        bias: bool,
        checkpoint_shards: bool = True,
    ) -> None:
        super().__init__()
        self.shards = dict(shards)
        self.checkpoint_shards = checkpoint_shards
        local = sum(s.local_size for s in self.shards.values())
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None

    @property
    def shard_ids(self) -> tuple[str | None, ...]:
        return tuple(self.shards) if self.checkpoint_shards else (None,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, local rows]
        return linear(x, self.weight, self.bias)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[..., local rows]`` -> one ``[..., shard's local size]`` view per shard, in order."""
        return out.split([s.local_size for s in self.shards.values()], dim=-1)

    def weight_loader(
        self, param: torch.Tensor, loaded: LoadedTensor, shard_id: str | None
    ) -> None:
        if shard_id is not None and shard_id not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {tuple(self.shards)}")
        total = sum(s.size for s in self.shards.values())
        if shard_id is None:
            _check_size(loaded, 0, total, "the fused projections")
        local_offset = stored_offset = 0
        for name, shard in self.shards.items():
            if shard_id is None or name == shard_id:
                if shard_id is not None:
                    _check_size(loaded, 0, shard.size, f"shard {name!r}")
                part = loaded.narrow(0, stored_offset + shard.start, shard.local_size)
                copy_checked(param.data.narrow(0, local_offset, shard.local_size), part)
            local_offset += shard.local_size
            stored_offset += shard.size if shard_id is None else 0


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r W_r^T) + b``: this rank's columns of a projection whose input is a
    column-parallel output split the same way (evenly). The bias is whole on every rank and added
    once, after the sum."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, what: str
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_shard = OutputShard.split(in_features, tp, what)
        self.weight = nn.Parameter(torch.empty(out_features, self.input_shard.local_size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, local in] -> [T, out]
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)

    def weight_loader(
        self, param: torch.Tensor, loaded: LoadedTensor, shard_id: str | None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for a row-parallel parameter")
        if param is self.bias:
            copy_checked(param.data, read_whole(loaded))
            return
        shard = self.input_shard
        _check_size(loaded, 1, shard.size, "a row-parallel weight")
        copy_checked(param.data, loaded.narrow(1, shard.start, shard.local_size))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of a ``[vocab_size, dim]`` embedding: ids ``[start, start + num_valid)``,
    padded with zero rows to ``ceil(vocab_size / size)`` rows so every rank's shard is alike. A
    lookup embeds the ids this rank holds, zeroes the others, and sums over the ranks."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        rows = -(-vocab_size // tp.size)
        self.start = tp.rank * rows
        self.num_valid = max(0, min(rows, vocab_size - self.start))
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))

    def weight_loader(
        self, param: torch.Tensor, loaded: LoadedTensor, shard_id: str | None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for an embedding")
        _check_size(loaded, 0, self.vocab_size, "a vocabulary-parallel embedding")
        copy_checked(param.data[: self.num_valid], loaded.narrow(0, self.start, self.num_valid))
        param.data[self.num_valid :].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over a vocabulary-parallel weight (shared with the embedding when the
    config ties them): each rank computes its rows' logits, and every rank all-gathers the whole
    vocabulary's (rank 0 samples from them)."""

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, dim]`` -> ``[n, vocab_size]`` in the model dtype, into ``out`` when given."""
        if self.tp.size == 1:
            return torch.mm(hidden, self.weight.t(), out=out)
        local = torch.mm(hidden, self.weight.t())  # [n, rows]
        n, rows = local.shape
        gathered = self.tp.all_gather(local).view(self.tp.size, n, rows)
        full = gathered.permute(1, 0, 2).reshape(n, self.tp.size * rows)[:, : self.vocab_size]
        return full.contiguous() if out is None else out.copy_(full)
