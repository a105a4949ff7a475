"""Layers shared by the model families, and how their weights load.

A module may define ``weight_loader(param, loaded, shard_id)`` (and ``shard_ids``, the shards its parameters
are assembled from); the loader calls it for every checkpoint tensor that maps to one of the module's
parameters. Modules without one load with `default_weight_loader`.

The element-wise steps between the matmuls (residual add + RMSNorm, rotary, SwiGLU's gate) are fused ops from
``kernels/``, chosen per call by `by_device`: their Triton kernels on CUDA, their PyTorch references elsewhere
(on the CPU the models then compute exactly what transformers' models compute).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.rms_norm import rms_norm_ref, rms_norm_triton

Op = TypeVar("Op", bound=Callable)


def use_triton(x: torch.Tensor) -> bool:
    """Whether a fused op on ``x`` runs its Triton kernel (on CUDA) or its PyTorch reference."""
    return x.is_cuda


def by_device(triton_fn: Op, ref_fn: Op) -> Op:
    """One op from its two implementations, chosen by `use_triton` on the op's first argument."""

    def op(x: torch.Tensor, *args, **kwargs):
        return (triton_fn if use_triton(x) else ref_fn)(x, *args, **kwargs)

    return op  # type: ignore[return-value]


rms_norm = by_device(rms_norm_triton, rms_norm_ref)
silu_and_mul = by_device(silu_and_mul_triton, silu_and_mul_ref)


def default_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None
) -> None:
    """Copy a whole, unfused tensor into ``param`` (casting to its dtype and device)."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for an unfused parameter")
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, parameter {tuple(param.shape)}"
        )
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

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None
    ) -> None:
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
    """RMSNorm computed in float32 and cast back before the weight, exactly as transformers' Llama does,
    optionally after adding a residual (see kernels/rms_norm.py)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, dim]`` or ``[T, heads, dim]`` -> ``norm(x)``; with ``residual`` (like ``x``), returns
        ``(norm(x + residual), x + residual)``."""
        out, new_residual = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, new_residual)
