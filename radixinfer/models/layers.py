"""Layers shared by the model families, and how their weights load.

A module may define ``weight_loader(param, loaded, shard_id)`` (and ``shard_ids``, the shards its parameters
are assembled from); the loader calls it for every checkpoint tensor that maps to one of the module's
parameters, as a `CheckpointTensor` it reads only the needed part of. Modules without one load with
`default_weight_loader`. The sharded layers of tensor parallelism: `radixinfer.models.parallel`.

The element-wise steps between the matmuls (residual add + RMSNorm, SwiGLU's gate) are fused ops from
``kernels/``, chosen per call by `by_device`: their Triton kernels on CUDA, their PyTorch references elsewhere
(on the CPU the models then compute exactly what transformers' models compute). Rotary embedding is fused
into the attention backend's KV store instead (`radixinfer.attention.backend.AttentionBackend.store_and_attend`),
which the device chooses the same way. The linear layers run ``F.linear`` (cuBLAS) except for
half-precision batches of 1-2 tokens on weights of up to 64 MiB (128 MiB where a row fits one weight
tile) on CUDA, which take the skinny GEMM (`use_skinny_gemm`); SwiGLU's gate/up projection then computes
SiLU-and-mul as it stores (`linear_silu_and_mul`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kernels.skinny_gemm import linear_silu_and_mul_triton, linear_triton, tile_k

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

# The skinny GEMM (kernels/skinny_gemm.py) is on unless ``RADIXINFER_SKINNY_GEMM=0`` (read once, at import, by
# every process of the engine): an A/B of the same code against cuBLAS everywhere.
SKINNY_GEMM = os.environ.get("RADIXINFER_SKINNY_GEMM", "1") != "0"
# The most tokens the skinny GEMM takes (the kernel takes up to `kernels.skinny_gemm.MAX_REDUCE_M`, 4); three
# and four tokens run its four-row kernel, which the rule has not been measured for.
SKINNY_MAX_TOKENS = 2
# The largest weights it takes: up to 64 MiB, or up to 128 MiB where a row fits one weight tile at the token
# count (`kernels.skinny_gemm.tile_k`: 4,096 at one token). Alone (benchmarks/bench_skinny_gemm.py, H200) it
# beats cuBLAS at one token on every weight of qwen2.5-0.5b and llama-3.1-8b at TP 1 and 2 but llama-3.1-8b's
# 117 MB down_proj (K = 14,336: 37.5 vs 37.2 us); cuBLAS costs ~7 us a call beyond the weight's bytes, the
# persistent grid ~3. In llama-3.1-8b's decode step (docs/kernels.md) the kernel gains on TP=2's 117 MB
# gate_up at one token (3,117 against 3,248 us) and loses on TP=1's 235 MB gate_up (4,384 against 4,358 us;
# at two tokens, two K tiles a row, 4,838 against 4,528) and 117 MB down_proj (4,419 against 4,376 us).
SKINNY_MAX_WEIGHT_BYTES = 64 * 2**20
SKINNY_MAX_ONE_TILE_WEIGHT_BYTES = 128 * 2**20


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear layer on ``x`` ``[T, in]`` with ``weight`` ``[out, in]`` runs the skinny GEMM:

    - fused ops on Triton (CUDA) and the switch on (`SKINNY_GEMM`);
    - a float16/bfloat16 ``x``, 2-D with unit stride along ``in``;
    - the shape `skinny_gemm_suits`.

    Everything else runs ``F.linear`` (cuBLAS), and so does everything on the CPU, bit for bit as before."""
    return (
        SKINNY_GEMM
        and use_triton(x)
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.dim() == 2
        and x.stride(1) == 1
        and skinny_gemm_suits(x.shape[0], weight.shape[1], weight.numel() * weight.element_size())
    )


def skinny_gemm_suits(num_tokens: int, in_features: int, weight_bytes: int) -> bool:
    """`use_skinny_gemm`'s shape test: at most `SKINNY_MAX_TOKENS` tokens, on at most
    `SKINNY_MAX_WEIGHT_BYTES` of weight, or at most `SKINNY_MAX_ONE_TILE_WEIGHT_BYTES` where ``in_features``
    fits one weight tile (``benchmarks/bench_skinny_gemm.py`` applies it to shapes without tensors)."""
    if num_tokens > SKINNY_MAX_TOKENS:
        return False
    one_tile = in_features <= tile_k(num_tokens, in_features)
    limit = SKINNY_MAX_ONE_TILE_WEIGHT_BYTES if one_tile else SKINNY_MAX_WEIGHT_BYTES
    return weight_bytes <= limit


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [T, in], [out, in], [out] -> [T, out]
    """``F.linear``, through the skinny GEMM where `use_skinny_gemm` says."""
    return (linear_triton if use_skinny_gemm(x, weight) else F.linear)(x, weight, bias)


def linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [T, in], [2 I, in] (gate | up), [2 I] -> [T, I]
    """SwiGLU's gate over the fused gate/up projection, ``silu(x W_gate^T + b_gate) * (x W_up^T + b_up)``:
    where `use_skinny_gemm` takes the projection, one launch (the skinny GEMM with SiLU-and-mul as it
    stores); else the projection, then `silu_and_mul` (on the CPU, the references)."""
    if use_skinny_gemm(x, weight):
        return linear_silu_and_mul_triton(x, weight, bias)
    return silu_and_mul(F.linear(x, weight, bias))


class CheckpointTensor:
    """A tensor of a safetensors checkpoint, read only in the parts a weight loader asks for.

    ``narrow(dim, start, length)`` reads one slice (a rank's rows or columns of a sharded weight,
    and nothing else); `read_whole` reads it all. ``t()`` swaps the two dimensions of a matrix
    without reading anything (GPT-2 stores its projections transposed). A plain tensor offers the
    same ``shape`` / ``narrow`` / ``t``, so loaders take either.
    """

    def __init__(self, source, transposed: bool = False) -> None:
        self._source = source  # safetensors' slice handle (``safe_open(...).get_slice(name)``)
        self._transposed = transposed
        shape = tuple(source.get_shape())
        self.shape = torch.Size(shape[::-1] if transposed else shape)

    def t(self) -> CheckpointTensor:
        if len(self.shape) != 2:
            raise ValueError(f"t() of a {len(self.shape)}-d checkpoint tensor")
        return CheckpointTensor(self._source, not self._transposed)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        stored_dim = 1 - dim if self._transposed else dim
        index = [slice(None)] * len(self.shape)
        index[stored_dim] = slice(start, start + length)
        part = self._source[tuple(index)]
        return part.t() if self._transposed else part

    def read(self) -> torch.Tensor:
        part = self._source[...] if not self.shape else self._source[:]
        return part.t() if self._transposed else part


LoadedTensor = torch.Tensor | CheckpointTensor


def read_whole(loaded: LoadedTensor) -> torch.Tensor:
    """The whole of ``loaded``, as a tensor."""
    return loaded.read() if isinstance(loaded, CheckpointTensor) else loaded


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param`` (casting to its dtype and device) after checking shapes."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, parameter {tuple(param.shape)}"
        )
    param.copy_(loaded)


def default_weight_loader(
    param: torch.Tensor, loaded: LoadedTensor, shard_id: str | None = None
) -> None:
    """Copy a whole, unfused, unsharded tensor into ``param``."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for an unfused parameter")
    copy_checked(param.data, read_whole(loaded))


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
