"""Per-request logits processing before sampling: ``min_tokens``, ``logit_bias`` and the repetition,
presence and frequency penalties (vLLM's semantics and order; `SamplingParams` documents them).

Only the rows of requests that process their logits are touched, in place in the step's logits
(their dtype; the penalties compute in float32): the sampler hands over logits that nothing reads
after it (the raw logprobs are taken before), so a step allocates nothing, and a batch without such
rows pays nothing. The penalties read each request's token counts from `TokenCounts`, rows of a
device tensor that grow by the sampled tokens every step (one launch adds the new tokens), never
rebuilt from the host's lists.

No host sync on a step's path: a batch that keeps its requests reuses its plan (the count rows and
batch positions already on the device), so a step is two launches, with no copy from the host, no
read back, and no allocation. (A per-step ``[rows, vocab]`` copy, 78 MB at batch 256 x 151,936
bf16, was once a penalised step's only difference from a plain sampled one besides the launches:
where the memory plan leaves no cached block for it, the caching allocator frees its cache to find
one, and freeing waits for the device.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.penalties import (
    count_tokens_ref,
    count_tokens_triton,
    penalize_ref,
    penalize_triton,
)
from radixinfer.models.layers import by_device

if TYPE_CHECKING:
    from radixinfer.cache.kv_manager import SeqKV
    from radixinfer.engine.request import Request


penalize = by_device(penalize_triton, penalize_ref)  # see `kernels.penalties`
count_tokens = by_device(count_tokens_triton, count_tokens_ref)


class TokenCounts:
    """Device rows of token counts, one per penalised request while it holds KV: ``prompt_seen``
    ``[rows, vocab]`` bool marks its prompt's tokens, ``output_counts`` ``[rows, vocab]`` int32
    counts its sampled tokens, including those the host has not read back yet, and ``penalties``
    ``[rows, 3]`` float32 holds its repetition, presence and frequency penalties.

    A request's row is valid while its sequence is the one the row was filled for: a request
    preempted and admitted again gets a new sequence, and its row is refilled from its prompt and
    the output the host holds (a preemption reads every token back first). Rows of requests that
    left are reclaimed when a new row is needed and none is free.

    Memory: the rows live between steps, so they are planned, not grown. The first penalised
    request allocates all ``capacity`` rows at once (``capacity * vocab * 5`` bytes; nothing
    before it), and there are never more: the scheduler admits at most
    ``capacity`` penalised sequences at once (``max_batch_size``), and the memory plan's worst-case
    step holds every row (`radixinfer.engine.memory`). A row wanted beyond them is a broken
    promise: RuntimeError. `release` gives the rows back.

    Performance: filling a row is a few launches per batch of new requests; each step adds the
    sampled tokens with one launch (`kernels.penalties.count_tokens_triton`)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"TokenCounts needs a capacity of at least one row, got {capacity}")
        self.vocab_size, self.device, self.capacity = vocab_size, device, capacity
        self.release()

    def release(self) -> None:
        """Forget every row and give the tensors back (the next row needed allocates them again)."""
        self.prompt_seen = torch.zeros(0, self.vocab_size, dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros(0, self.vocab_size, dtype=torch.int32, device=self.device)
        self.penalties = torch.zeros(0, 3, dtype=torch.float32, device=self.device)
        self._owners: dict[Request, tuple[int, SeqKV | None]] = {}
        self._free: list[int] = []

    def rows(self, reqs: Sequence[Request]) -> list[int]:
        """Each request's row, filling the rows of requests that have none valid."""
        fresh: list[tuple[int, Request]] = []
        rows = []
        for req in reqs:
            owned = self._owners.get(req)
            if owned is None or owned[1] is not req.seq:
                row = owned[0] if owned is not None else self._allocate()
                self._owners[req] = (row, req.seq)
                fresh.append((row, req))
            else:
                row = owned[0]
            rows.append(row)
        if fresh:
            self._fill(fresh)
        return rows

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count ``tokens [n]`` (on the device) once each in ``rows [n]``."""
        count_tokens(self.output_counts, rows, tokens)

    def _allocate(self) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            if self.output_counts.shape[0]:
                raise RuntimeError(
                    f"more than {self.capacity} penalised requests hold token-count rows at once "
                    "(the scheduler admits no more than that)"
                )
            self._allocate_rows()
        return self._free.pop()

    def _reclaim(self) -> None:
        """Free the rows of requests that no longer hold KV (finished, aborted or preempted)."""
        for req in [r for r, (_, seq) in self._owners.items() if r.seq is not seq]:
            self._free.append(self._owners.pop(req)[0])

    def _allocate_rows(self) -> None:
        """Every row at once: the planned bound, with no copy of old rows and no second size.
        Normal tensors even when the first row is taken under inference mode (the memory profile),
        so steps outside it may update them."""
        shape, device = (self.capacity, self.vocab_size), self.device
        with torch.inference_mode(False):
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=device)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=device)
            self.penalties = torch.zeros(self.capacity, 3, dtype=torch.float32, device=device)
        self._free = list(range(self.capacity - 1, -1, -1))

    def _fill(self, fresh: list[tuple[int, Request]]) -> None:
        """Set each fresh row to its request's prompt, the output the host holds and its
        penalties."""
        device = self.device
        rows = upload(torch.tensor([row for row, _ in fresh]), device)
        penalties = [
            (q.params.repetition_penalty, q.params.presence_penalty, q.params.frequency_penalty)
            for _, q in fresh
        ]
        self.penalties[rows] = upload(np.array(penalties, dtype=np.float32), device)
        self.prompt_seen.index_fill_(0, rows, False)
        self.output_counts.index_fill_(0, rows, 0)
        prompt_rows, prompt_ids = _row_id_pairs([(r, q.prompt_ids) for r, q in fresh], device)
        put_scalar(self.prompt_seen, prompt_rows, prompt_ids, True)
        if any(q.output_ids for _, q in fresh):
            self.add(*_row_id_pairs([(r, q.output_ids) for r, q in fresh], device))


def upload(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (a tensor or an array) on ``device`` without waiting for the device: a pageable
    copy would synchronise the stream (the host must never wait for the step it has just
    launched)."""
    if isinstance(host, np.ndarray):
        host = torch.from_numpy(host)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def put_scalar(
    target: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, value: bool | float
) -> None:
    """``target[rows, cols] = value`` without waiting for the device: assigning a Python scalar
    through tensor indices makes torch copy it to the device from pageable memory, which
    synchronises the stream (the host then waits for every step it has queued, once per penalised
    admission: ~10 ms a prefill step at batch 256 on qwen2.5-0.5b); a device scalar costs one fill
    launch."""
    target.index_put_((rows, cols), torch.full((), value, dtype=target.dtype, device=target.device))


def _row_id_pairs(
    items: list[tuple[int, Sequence[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, ids)`` int64 on ``device`` flattening each ``(row, ids)``: the row repeated once
    per id (one copy to the device)."""
    ids = [np.asarray(tokens, dtype=np.int64) for _, tokens in items]
    rows = np.repeat(np.asarray([row for row, _ in items], dtype=np.int64), [len(t) for t in ids])
    pairs = upload(np.stack([rows, np.concatenate(ids)]), device)
    return pairs[0], pairs[1]


@dataclass(frozen=True)
class _Plan:
    """What a batch's processing needs that stays fixed while its requests do: the penalised rows'
    batch positions and count rows (on the device), the rows with ``logit_bias`` or
    ``min_tokens``, and each request's sequence when its count row was last checked (a new one,
    after a preemption, means a refilled row: the plan is built again)."""

    reqs: tuple[Request, ...]
    seqs: tuple[SeqKV | None, ...]
    every: bool  # every row penalised
    special: list[int]  # rows with logit_bias or min_tokens
    columns: tuple[torch.Tensor, torch.Tensor] | None  # positions, count rows

    def holds_for(self, reqs: Sequence[Request]) -> bool:
        """Whether ``reqs`` are this plan's, with the same sequences where rows are penalised."""
        batch = tuple(reqs)
        if self.reqs != batch:
            return False
        return self.columns is None or all(r.seq is s for r, s in zip(batch, self.seqs))


class LogitsProcessor:
    """Applies the requests' ``min_tokens``, ``logit_bias`` and penalties to a step's logits and
    keeps the token counts the penalties read (`TokenCounts`, ``max_penalized`` rows: at most that
    many penalised requests hold KV at once).

    Performance: a batch that keeps its requests from one step to the next reuses its `_Plan`, so
    a penalised decode step costs the host a check of its requests and two launches."""

    def __init__(self, vocab_size: int, device: torch.device, max_penalized: int) -> None:
        self.counts = TokenCounts(vocab_size, device, max_penalized)
        self._last: _Plan | None = None

    def release(self) -> None:
        """Give back the token-count rows (`TokenCounts.release`) and forget the last batch's
        plan, whose count rows they were."""
        self.counts.release()
        self._last = None

    def process(
        self, reqs: Sequence[Request], logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """Process every processing request's row of ``logits [len(reqs), vocab]`` in place
        (``logit_bias`` and ``min_tokens``, then the penalties); the caller must not need the
        logits as they came afterwards. Returns what `record` needs: the penalised rows' batch
        positions (None: every row) and count rows, or None when no request is penalised."""
        plan = self._plan(reqs, logits.device)
        if plan.special:
            self._bias_and_min_tokens([(i, reqs[i]) for i in plan.special], logits)
        if plan.columns is None:
            return None
        positions, count_rows = plan.columns
        counts = self.counts
        penalize(
            logits, positions, count_rows, counts.prompt_seen, counts.output_counts,
            counts.penalties,
        )  # fmt: skip
        return (None if plan.every else positions, count_rows)

    def _plan(self, reqs: Sequence[Request], device: torch.device) -> _Plan:
        """The last call's plan if it holds for ``reqs``, else a new one (filling count rows)."""
        if self._last is not None and self._last.holds_for(reqs):
            return self._last
        params = [r.params for r in reqs]
        penalised = [i for i, p in enumerate(params) if p.penalized]
        special = [i for i, p in enumerate(params) if p.logit_bias or p.min_tokens > 0]
        every = len(penalised) == len(reqs)
        columns = None
        if penalised:
            pen_reqs = reqs if every else [reqs[i] for i in penalised]
            # [2, n] int64, one copy to the device: which batch row reads which count row
            host = np.array([penalised, self.counts.rows(pen_reqs)], dtype=np.int64)
            columns = tuple(upload(host, device))
        seqs = tuple(r.seq for r in reqs)
        self._last = _Plan(tuple(reqs), seqs, every, special, columns)
        return self._last

    def record(
        self, pending: tuple[torch.Tensor | None, torch.Tensor] | None, tokens: torch.Tensor
    ) -> None:
        """Count the step's sampled ``tokens [batch]`` in the penalised requests' rows."""
        if pending is not None:
            positions, count_rows = pending
            self.counts.add(count_rows, tokens if positions is None else tokens[positions])

    @staticmethod
    def _bias_and_min_tokens(special: list[tuple[int, Request]], logits: torch.Tensor) -> None:
        """Add each ``(row, request)``'s ``logit_bias`` to its row of ``logits``, then forbid its
        stop tokens while it has sampled fewer than ``min_tokens``. ``special``: the rows with a
        bias or ``min_tokens`` (the plan's), not the whole batch."""
        device = logits.device
        biased = [(i, r.params.logit_bias) for i, r in special if r.params.logit_bias]
        if biased:
            rows, ids = _row_id_pairs([(i, list(bias)) for i, bias in biased], device)
            values = torch.tensor([v for _, bias in biased for v in bias.values()])
            values = upload(values, device).to(logits.dtype)
            # a row's ids are distinct (dict keys): a gather and a plain put, no accumulating
            # index_put_ (which sorts its indices, and in older torch reads them back to check)
            logits[rows, ids] = logits[rows, ids] + values
        early = [(i, sorted(r.stop_ids)) for i, r in special if r.num_sampled < r.params.min_tokens]
        if early:
            rows, ids = _row_id_pairs(early, device)
            put_scalar(logits, rows, ids, float("-inf"))
