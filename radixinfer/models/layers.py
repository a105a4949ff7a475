"""Layers shared by the model families, and how their weights load.

A module may define ``weight_loader(param, loaded, shard_id)`` (and ``shard_ids``, the shards its parameters
are assembled from); the loader calls it for every checkpoint tensor that maps to one of the module's
parameters. Modules without one load with `default_weight_loader`.
"""

from __future__ import annotations

import torch
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
    """Copy a whole, unfused tensor into ``param`` (casting to its dtype and device)."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for an unfused parameter")
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class FusedLinear(nn.Linear):
    """Several projections of the same input as one matmul (q/k/v, gate/up).

    The output features are the shards concatenated in ``shard_sizes`` order; each checkpoint tensor of a
    shard (e.g. ``k_proj.weight``, ``k_proj.bias``) is copied into its rows at load time, so fusing happens
    here and nowhere else.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)

    @property
    def shard_ids(self) -> tuple[str, ...]:
        return tuple(self.shard_sizes)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None) -> None:
        if shard_id not in self.shard_sizes:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {self.shard_ids}")
        offset = 0
        for name, size in self.shard_sizes.items():
            if name == shard_id:
                break
            offset += size
        default_weight_loader(param.data.narrow(0, offset, self.shard_sizes[shard_id]), loaded)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[..., out_features]`` -> one ``[..., shard_size]`` view per shard, in order."""
        return out.split(list(self.shard_sizes.values()), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as transformers' Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
