"""Rotary position embeddings (rotate-half / GPT-NeoX layout, as transformers' Llama family).

Supported ``rope_type``: ``default``, ``linear`` and ``llama3``; read from ``rope_parameters``
(transformers 5) or ``rope_scaling`` + ``rope_theta`` (transformers 4).

This module makes the cos/sin tables; the rotation is applied by each attention layer's KV store
(``attend(..., cos, sin)``, `kernels/store_kv.py`), which rotates q and k in the launch that stores
K and V (at decode without shared-prefix tiles, the decode attention's launch, which stores them).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's RoPE settings as one dict with at least ``rope_type`` and ``rope_theta``."""
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(
    config: PretrainedConfig, head_dim: int
) -> torch.Tensor:  # [head_dim // 2] float32, on CPU
    """Inverse frequencies, computed on the CPU in float32 with transformers' formulas (bit-identical)."""
    params = rope_parameters(config)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params, config.max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, params: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, the band between interpolated."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context_len / low, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context_len / high) & (wavelen <= old_context_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position below ``max_positions``, computed once at construction (in float32, stored
    in the default dtype = the model dtype) on the default device; a forward only gathers rows."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)  # [P]
        freqs = positions[:, None] * rope_inv_freq(config, head_dim).to(
            positions.device
        )  # [P, head_dim // 2]
        self.register_buffer("cos", freqs.cos().to(torch.get_default_dtype()), persistent=False)
        self.register_buffer("sin", freqs.sin().to(torch.get_default_dtype()), persistent=False)

    def forward(
        self, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T] -> 2 x [T, head_dim // 2]
        return self.cos[positions], self.sin[positions]
