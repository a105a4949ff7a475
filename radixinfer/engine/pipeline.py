"""Token pipelining: step ``k``'s sampled tokens are read back in step ``k + 1``
(docs/request-lifecycle.md, Token pipelining).

A forward's sampled tokens stay on the device (a `Launch`), on their way to pinned host memory
without blocking. The next decode takes each request's newest token from there as its input
(`TokenPipeline.decode_inputs`), and the host reads a step's launches back only after the next
step's forwards are launched, so it plans step ``k + 1`` while the device still runs step ``k``. A
token reaches the caller one step after it is sampled.

What must hold: every launch is read back exactly once, oldest first, in the step after it was made
(or sooner, when the engine preempts: `TokenPipeline.take_all`); a request's newest token is in the
newest launch holding it that is not read back yet, else it is the last of its ``output_ids``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from radixinfer.engine.decode_batch import DecodeBatch
    from radixinfer.engine.logprobs import ScoredRows
    from radixinfer.engine.request import Request

# `ModelRunner.decode`'s ``carried_rows`` entry for a sequence whose input token is in ``input_ids``
READ_BACK_ROW = -1
_NO_ROWS = np.zeros(0, dtype=np.int64)


class Launch:
    """One forward's sampled tokens ``[len(reqs)]``: on the device, and on their way to pinned host
    memory without blocking. The engine reads them a step later, once the device has newer work
    queued behind them.

    A decode launch knows its ``batch``, the engine's departure count when it launched, and the rows
    whose token is their last by length (``last_rows``). Its read-back decides per request only for
    those rows, the stop tokens and, when the departure count has moved since, the rows of requests
    that stopped running: every other row goes out in one `TokenBatch`. A prefill launch has
    neither (``batch`` and ``departures`` None).

    ``scores``: the logprobs of the rows whose requests ask (`radixinfer.engine.logprobs`), copied
    to the host with the tokens."""

    def __init__(
        self,
        reqs: list[Request],
        tokens: torch.Tensor,
        batch: DecodeBatch | None = None,
        departures: int | None = None,
        scores: ScoredRows | None = None,
    ) -> None:
        self.reqs, self.tokens = reqs, tokens
        self.batch, self.departures = batch, departures
        # `ndarray.nonzero`: `np.flatnonzero` costs ~8 Python calls, each step
        self.last_rows = (batch.left == 1).nonzero()[0] if batch is not None else _NO_ROWS
        self.read_back = False
        self.scores = scores
        self.host, self.done = tokens, None
        self.host_scores = None if scores is None else scores.packed
        if tokens.device.type == "cuda":
            self.host = _to_pinned(tokens)
            if scores is not None:
                self.host_scores = _to_pinned(scores.packed)
            self.done = torch.cuda.Event()
            self.done.record()

    def read(self) -> list[int]:
        """The tokens, on the host (waits for the copy, by then long done)."""
        if self.done is not None:
            self.done.synchronize()
        self.read_back = True
        return self.host.tolist()

    def read_scores(self) -> list[list[float]]:
        """The packed logprob rows of ``scores`` on the host (after `read`)."""
        return self.host_scores.tolist()


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 index tensor on ``device``, copied from pinned memory without blocking
    the host (a plain copy from a list would wait for the forward just launched)."""
    index = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    return index


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, on its way without blocking."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class TokenPipeline:
    """The launches whose tokens the host has not read back: the previous step's (read back during
    this step) and this step's (read back during the next)."""

    def __init__(self) -> None:
        self.previous: list[Launch] = []
        self.current: list[Launch] = []

    def next_step(self) -> list[Launch]:
        """Start a step: this step's launches become the previous ones; returns them (to read back
        once this step's forwards are launched)."""
        self.previous, self.current = self.current, []
        return self.previous

    def take_all(self) -> list[Launch]:
        """Every launch not read back, oldest first, leaving none (the engine reads them back at
        once, before a preemption publishes its victims' tokens)."""
        launches = self.previous + self.current
        self.previous, self.current = [], []
        return launches

    def launch(
        self,
        reqs: list[Request],
        tokens: torch.Tensor,
        batch: DecodeBatch | None = None,
        departures: int | None = None,
        scores: ScoredRows | None = None,
    ) -> Launch:
        """Record that ``tokens`` (sampled on the device, one per request) will be read back next
        step; each request has sampled one more token."""
        launch = Launch(reqs, tokens, batch, departures, scores)
        for req in reqs:
            req.num_sampled += 1
        self.current.append(launch)
        return launch

    def has_unread(self) -> bool:
        """Whether a launch waits for the next step's read-back (between steps, the previous step's
        launches are all read)."""
        return bool(self.current)

    def decode_inputs(
        self, reqs: list[Request]
    ) -> tuple[np.ndarray, torch.Tensor | None, list[int] | None]:
        """``(input_ids, carried, carried_rows)`` for `ModelRunner.decode`. A sequence's input token
        is its newest id when read back (its carried row `READ_BACK_ROW`), else a placeholder id and
        its row in the concatenated tokens of the launches holding the batch's newest tokens.

        Performance: one pass over the launches not read back and one over the batch; a repeated
        decode batch needs neither (its inputs are its last launch's tokens, row for row)."""
        newest: dict[Request, tuple[Launch, int]] = {}
        for launch in self.previous + self.current:  # oldest first: a newer launch overrides
            if not launch.read_back:
                for row, req in enumerate(launch.reqs):
                    newest[req] = (launch, row)
        offsets: dict[Launch, int] = {}
        total = 0
        input_ids, rows = [], []
        last, offset = None, 0  # the launch of the previous carried row, and its offset
        for req in reqs:
            carry = newest.get(req)
            if carry is None:
                input_ids.append(req.output_ids[-1])
                rows.append(READ_BACK_ROW)
                continue
            launch, row = carry
            if launch is not last:  # (rows of one launch mostly come together: no look-up)
                last, offset = launch, offsets.get(launch)
                if offset is None:
                    offset = offsets[launch] = total
                    total += len(launch.reqs)
            input_ids.append(0)
            rows.append(offset + row)
        ids = np.asarray(input_ids, dtype=np.int64)
        if not offsets:
            return ids, None, None
        tokens = [launch.tokens for launch in offsets]
        return ids, tokens[0] if len(tokens) == 1 else torch.cat(tokens), rows
