"""Batched sampling on the device: greedy, temperature, top-k, top-p, with per-request seeds.

Randomness is counter-based: the noise for request ``r`` at its ``step``-th sampled token is a hash of
``(seed_r, step, vocab id)``, so a seeded request draws the same tokens whatever else shares its batch and
whatever order the batch is in. Sampling from the filtered softmax uses the Gumbel-max trick
(``argmax(logits / T + Gumbel noise)``), which is exact and needs no per-row loop or generator object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.argmax import argmax_ref, argmax_triton
from radixinfer.models.layers import by_device

if TYPE_CHECKING:
    from radixinfer.engine.request import Request

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # products of values < 2**32 with it stay below 2**63: no int64 overflow


def _hash32(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """A 32-bit integer mixer (avalanches every input bit) on int64 tensors or arrays holding values < 2**32."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def seed_bits(seeds: list[int]) -> np.ndarray:
    """``[num_rows]`` int64 holding the bits of unsigned 64-bit seeds (those >= 2**63 read as negative)."""
    return np.array(seeds, dtype=np.uint64).view(np.int64)


def row_keys(
    seeds: torch.Tensor | np.ndarray, steps: torch.Tensor | np.ndarray
) -> torch.Tensor | np.ndarray:
    """``[num_rows]`` int64: one key per (seed, step); the noise of a row is a function of its key alone.
    ``seeds`` holds 64-bit seeds' bits (`seed_bits`): the high word offsets the step's hash, the low
    word is mixed in after, so seeds differing in any bit give different streams (one 32-bit key per
    step; a seed below 2**32 keys exactly as the low word alone). Numpy arrays or tensors alike (the
    sampler computes them on the host, where they are a few µs)."""
    high = _hash32((seeds >> 32) & _MASK32)
    return _hash32((seeds & _MASK32) ^ _hash32((steps & _MASK32) ^ high))


def noise_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[num_rows, vocab_size]`` uniforms in (0, 1) from ``keys [num_rows]`` int64 (see `row_keys`)."""
    cols = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _hash32(keys[:, None] ^ cols[None, :])  # [num_rows, vocab]
    return (bits.to(torch.float64) + 0.5).div_(2.0**32).to(torch.float32)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[num_rows, vocab_size]`` uniforms in (0, 1), a pure function of (seed, step, column)."""
    return noise_from_keys(row_keys(seeds, steps), vocab_size)


_EMPTY: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as device tensors, built once per step (empty tensors when all rows are
    greedy). The noise of row ``r`` depends on its request's seed and on how many tokens the request has
    sampled so far (its step), through ``keys[r] = row_keys(seed, step)``."""

    temperature: torch.Tensor  # [num_rows] float32; 0 = greedy
    top_p: torch.Tensor  # [num_rows] float32
    top_k: torch.Tensor  # [num_rows] int64; 0 = off
    keys: torch.Tensor  # [num_rows] int64
    all_greedy: bool
    any_filter: bool  # some row uses top-k or top-p

    @classmethod
    def greedy(cls, device: torch.device) -> SamplingBatch:
        """A batch whose every row is greedy: no per-row tensors at all."""
        empty = _EMPTY.get(device)
        if empty is None:
            empty = _EMPTY[device] = torch.empty(0, device=device)
        return cls(empty, empty, empty, empty, True, False)

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_p: list[float],
        top_k: list[int],
        seeds: list[int],
        steps: list[int],
        device: torch.device,
    ) -> SamplingBatch:
        """Four per-row columns in one host array and one copy to the device (none for all-greedy). The noise
        keys are hashed here, on a few hundred ints, instead of in ~20 tiny device kernels."""
        if not any(temperature):
            return cls.greedy(device)
        any_filter = (
            any(top_k) or min(top_p) < 1.0
        )  # top_k >= 0 and top_p <= 1 (SamplingParams validates)
        keys = row_keys(seed_bits(seeds), np.asarray(steps, dtype=np.int64))
        # [4, rows] float64: holds every int < 2**53 exactly, so keys (< 2**32) and top-k survive the trip
        host = torch.from_numpy(np.array([temperature, top_p, top_k, keys], dtype=np.float64))
        if device.type == "cuda":
            host = host.pin_memory()
        columns = host.to(device, non_blocking=True)
        floats, ints = columns[:2].float(), columns[2:].long()
        return cls(floats[0], floats[1], ints[0], ints[1], False, any_filter)


def _filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf (rows with k=0, p=1 are unchanged)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    drop = ranks >= k
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop |= mass_before >= top_p[:, None]  # keeps at least the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


argmax = by_device(
    argmax_triton, argmax_ref
)  # [rows, vocab] -> [rows] int64, the first index of each max


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits [num_rows, vocab]`` (any float dtype; sampling happens in float32) -> sampled token ids
    ``[num_rows]`` int64 (on the device)."""
    greedy_ids = argmax(logits)
    if batch.all_greedy:
        return greedy_ids
    temperature = batch.temperature.clamp(min=1e-5)[:, None]
    scaled = logits.float() / temperature
    if batch.any_filter:
        scaled = _filter_top_k_top_p(scaled, batch.top_k, batch.top_p)
    gumbel = -torch.log(-torch.log(noise_from_keys(batch.keys, logits.shape[-1])))
    sampled_ids = argmax(scaled + gumbel)
    return torch.where(batch.temperature > 0, sampled_ids, greedy_ids)


def sample_requests(
    reqs: Sequence[Request], logits: torch.Tensor, greedy: bool | None = None
) -> torch.Tensor:
    """Sampled token ids ``[len(reqs)]`` for ``logits`` ``[len(reqs), vocab]``, each row with its
    request's parameters, seed and count of sampled tokens; on the device (no host sync).
    ``greedy``: whether every request samples greedily, when the caller knows."""
    if greedy is None:
        greedy = not any(r.params.temperature for r in reqs)
    if greedy:
        return sample(logits, SamplingBatch.greedy(logits.device))
    batch = SamplingBatch.build(
        [r.params.temperature for r in reqs],
        [r.params.top_p for r in reqs],
        [r.params.top_k for r in reqs],
        [r.seed for r in reqs],
        [r.num_sampled for r in reqs],
        logits.device,
    )
    return sample(logits, batch)
