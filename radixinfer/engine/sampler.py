"""Batched sampling on the device: greedy, temperature, min-p, top-k, top-p, with per-request seeds,
after the requests' logits processing (`radixinfer.engine.logits_processing`).

Randomness is counter-based: the noise for request ``r`` at its ``step``-th sampled token is a hash of
``(seed_r, step, vocab id)``, so a seeded request draws the same tokens whatever else shares its batch and
whatever order the batch is in. Sampling from the filtered softmax uses the Gumbel-max trick
(``argmax(logits / T + Gumbel noise)``), which is exact and needs no per-row loop or generator object.
On CUDA one Triton kernel filters and draws without sorting the vocabulary (`kernels.sampling`); on
the CPU its sorting PyTorch reference does the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.argmax import argmax_ref, argmax_triton
from kernels.sampling import sample_ref, sample_triton
from radixinfer.engine.logits_processing import LogitsProcessor, upload
from radixinfer.engine.logprobs import ScoredRows, raw_logprobs, score_sampled
from radixinfer.models.layers import by_device

if TYPE_CHECKING:
    from radixinfer.engine.request import Request

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # products of values < 2**32 with it stay below 2**63: no int64 overflow


_Ints = torch.Tensor | np.ndarray  # int64, values < 2**32 unless said otherwise


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
    return _step_keys(*_seed_words(seeds), steps)


def _seed_words(seeds: _Ints) -> tuple[_Ints, _Ints]:
    """A seed's two parts of its keys (`row_keys`), fixed for a request: its low word, and the hash
    of its high word."""
    return seeds & _MASK32, _hash32((seeds >> 32) & _MASK32)


def _step_keys(low: _Ints, high: _Ints, steps: _Ints) -> _Ints:
    return _hash32(low ^ _hash32((steps & _MASK32) ^ high))


_EMPTY: dict[torch.device, torch.Tensor] = {}
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step as device tensors (empty tensors when all rows are
    greedy): its keys are the step's own, the other columns shared by the steps of one batch
    (`RowParams`). The noise of row ``r`` depends on its request's seed and on how many tokens the request has
    sampled so far (its step), through ``keys[r] = row_keys(seed, step)``."""

    inv_temperature: torch.Tensor  # [num_rows] float32: 1 / temperature; 0 = greedy
    top_p: torch.Tensor  # [num_rows] float32; 1 = off
    top_k: torch.Tensor  # [num_rows] int64; 0 = off
    min_p: torch.Tensor  # [num_rows] float32; 0 = off
    keys: torch.Tensor  # [num_rows] int64
    all_greedy: bool
    # whether some sampled row uses top-k, top-p, min-p: the kernel launches only their passes
    filters: tuple[bool, bool, bool] = (True, True, True)

    @classmethod
    def greedy(cls, device: torch.device) -> SamplingBatch:
        """A batch whose every row is greedy: no per-row tensors at all."""
        empty = _EMPTY.get(device)
        if empty is None:
            empty = _EMPTY[device] = torch.empty(0, device=device)
        return cls(empty, empty, empty, empty, empty, True, (False, False, False))

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_p: list[float],
        top_k: list[int],
        seeds: list[int],
        steps: list[int],
        device: torch.device,
        min_p: list[float] | None = None,
    ) -> SamplingBatch:
        """The batch of one step from its per-row columns (`RowParams`, then its step's keys)."""
        params = RowParams.build(temperature, top_p, top_k, seeds, device, min_p)
        return params.batch(np.asarray(steps, dtype=np.int64))


@dataclass(frozen=True)
class RowParams:
    """A batch's per-row sampling parameters that stay fixed while its requests do: the filter
    columns on the device (None when every row is greedy) and each seed's parts of its noise keys;
    a step's `SamplingBatch` adds only its keys (`batch`), so a decode batch that keeps its requests
    uploads ``[rows]`` keys a step and nothing else."""

    device: torch.device
    columns: tuple[torch.Tensor, ...] | None  # inv_temperature, top_p, top_k, min_p
    seed_low: np.ndarray  # int64: each seed's low word
    seed_high: np.ndarray  # int64: the hash of each seed's high word
    filters: tuple[bool, bool, bool]

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_p: list[float],
        top_k: list[int],
        seeds: list[int],
        device: torch.device,
        min_p: list[float] | None = None,
    ) -> RowParams:
        """Four per-row columns in one host array and one copy to the device (none for
        all-greedy)."""
        low, high = _seed_words(seed_bits(seeds))
        temps = np.asarray(temperature, dtype=np.float64)
        if not temps.any():
            return cls(device, None, low, high, (False, False, False))
        # 1 / max(T, 1e-5): a tinier temperature would scale logits to inf (then inf - inf = NaN)
        inv_temperature = np.divide(
            1.0, np.maximum(temps, MIN_TEMPERATURE), out=np.zeros_like(temps), where=temps > 0
        )
        top_p = np.asarray(top_p, dtype=np.float64)
        top_k = np.asarray(top_k, dtype=np.float64)
        min_p = np.zeros_like(temps) if min_p is None else np.asarray(min_p, dtype=np.float64)
        sampled = temps > 0
        filters = (
            bool((top_k > 0)[sampled].any()),
            bool((top_p < 1)[sampled].any()),
            bool((min_p > 0)[sampled].any()),
        )
        # [4, rows] float64: holds every int < 2**53 exactly, so top-k survives the trip
        columns = upload(np.stack([inv_temperature, top_p, min_p, top_k]), device)
        floats = columns[:3].float()
        return cls(device, (floats[0], floats[1], columns[3].long(), floats[2]), low, high, filters)

    def batch(self, steps: np.ndarray) -> SamplingBatch:
        """The step's batch: ``steps [rows]`` int64, each row's count of sampled tokens, hashed
        into its keys on the host (a few hundred ints: a few µs, where the device would take ~20
        tiny kernels) and copied to the device."""
        if self.columns is None:
            return SamplingBatch.greedy(self.device)
        keys = upload(_step_keys(self.seed_low, self.seed_high, steps), self.device)
        return SamplingBatch(*self.columns, keys, False, self.filters)


argmax = by_device(
    argmax_triton, argmax_ref
)  # [rows, vocab] -> [rows] int64, the first index of each max


def _sample_ref(*args: torch.Tensor, filters: tuple[bool, bool, bool]) -> torch.Tensor:
    return sample_ref(*args)


sample_rows = by_device(sample_triton, _sample_ref)  # see `kernels.sampling`


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits [num_rows, vocab]`` (any float dtype; sampling happens in float32) -> sampled token ids
    ``[num_rows]`` int64 (on the device)."""
    if batch.all_greedy:
        return argmax(logits)
    return sample_rows(
        logits, batch.inv_temperature, batch.top_k, batch.top_p, batch.min_p, batch.keys,
        filters=batch.filters,
    )  # fmt: skip


class Sampler:
    """Samples a step's tokens, one per request, each with its request's parameters, seed and count
    of sampled tokens, on the device (no host sync); owns the device state of the requests' logits
    processing (`LogitsProcessor`, token-count rows for ``max_penalized`` penalised requests).

    One sampler serves a runner: the engine's steps sample through `sample_with_logprobs`, and so
    does the memory profile's worst-case step (`ModelRunner.run_worst_case_step`), so the plan
    measures what the engine allocates."""

    def __init__(self, vocab_size: int, device: torch.device, max_penalized: int) -> None:
        self.logits_processor = LogitsProcessor(vocab_size, device, max_penalized)
        self._last: tuple[tuple[Request, ...], RowParams] | None = None  # the last batch's params

    @torch.inference_mode()  # the runner's logits are inference tensors, processed in place
    def sample(
        self, reqs: Sequence[Request], logits: torch.Tensor, argmax_only: bool | None = None
    ) -> torch.Tensor:
        """Sampled token ids ``[len(reqs)]`` for ``logits [len(reqs), vocab]``, which the caller
        hands over: the rows of requests with penalties, ``logit_bias`` or ``min_tokens`` are
        processed in place. ``argmax_only``: whether every request takes the argmax of its logits
        as they come, when the caller knows."""
        if argmax_only is None:
            argmax_only = all([r.params.argmax_only for r in reqs])  # (a list: no call per row)
        if argmax_only:
            return argmax(logits)
        pending = self.logits_processor.process(reqs, logits)  # in place
        steps = np.array([r.num_sampled for r in reqs], dtype=np.int64)
        tokens = sample(logits, self._row_params(reqs, logits.device).batch(steps))
        self.logits_processor.record(pending, tokens)
        return tokens

    def sample_with_logprobs(
        self,
        reqs: Sequence[Request],
        logits: torch.Tensor,
        scored_rows: list[int],
        argmax_only: bool | None = None,
    ) -> tuple[torch.Tensor, ScoredRows | None]:
        """`sample`, and the sampled tokens of ``scored_rows`` (the rows of requests asking for
        logprobs, `radixinfer.engine.logprobs.logprob_rows`) scored against the raw logits, taken
        before processing may change them: ``(tokens, scores)``, scores None when no row asks."""
        raw = raw_logprobs(logits, scored_rows) if scored_rows else None
        tokens = self.sample(reqs, logits, argmax_only)
        return tokens, None if raw is None else score_sampled(raw, reqs, tokens)

    def release(self) -> None:
        """Give back the device state that lives between steps (the token-count rows). Only while
        no penalised request holds KV: a later one's row is refilled from what the host holds."""
        self.logits_processor.release()

    def _row_params(self, reqs: Sequence[Request], device: torch.device) -> RowParams:
        """The requests' `RowParams`, built again only when the batch's requests (or their order)
        changed since the last call: a request's parameters and seed never change."""
        batch = tuple(reqs)
        if self._last is None or self._last[0] != batch or self._last[1].device != device:
            params = [r.params for r in reqs]
            row_params = RowParams.build(
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.top_k for p in params],
                [r.seed for r in reqs],
                device,
                min_p=[p.min_p for p in params],
            )
            self._last = batch, row_params
        return self._last[1]
