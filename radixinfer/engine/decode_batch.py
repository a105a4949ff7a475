"""The persistent decode batch: the running requests decoded together, built once and decoded again
for as long as it stays the same (docs/request-lifecycle.md, Decode)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixinfer.cache.kv_manager import DecodeLanes
from radixinfer.engine.logprobs import logprob_rows
from radixinfer.engine.request import Request


@dataclass
class DecodeBatch:
    """A decode batch, built once and decoded again for as long as it stays the same: the same
    requests in the same order, each with room for one more token (no request started or stopped
    running: the scheduler's ``epoch`` is the one it was built at, and ``left`` > 0 everywhere).
    Each step then grows every sequence by exactly one position and decodes the token its last
    launch sampled, so nothing on the step's path walks the requests: lengths and boundary blocks
    live in ``lanes``, the tables are the sequences' own lists, and what the sampler and the
    read-back need of the members is gathered here once.

    A running sequence's table is edited only by the decode step's `reserve_step`, which says which
    ones (publishing and releasing happen before a request runs and once it stops), so the runner
    compares no other table: neither while the batch repeats nor when it changes."""

    reqs: list[Request]
    lanes: DecodeLanes
    tables: list[list[int]]
    epoch: int
    left: np.ndarray  # [n] tokens each member may still sample
    greedy: bool  # every member takes the argmax of its logits as they come
    ids_only: bool  # every member: no detokenization, no logprobs, one sample (`TokenBatch` rows)
    logprob_rows: list[int]  # members that ask for logprobs
    stop_ids: np.ndarray  # every member's stop token ids, pooled
    request_ids: list[str]
    num_cached_tokens: list[int]
    tokens: torch.Tensor | None = None  # the last launch's sampled tokens, on the device

    @classmethod
    def build(cls, reqs: list[Request], epoch: int) -> DecodeBatch:
        """A batch of running requests that hold KV and have room for another token.

        Built whenever the running set changes (every step, while requests come and go): list
        comprehensions, not generators, which cost a Python call per request each."""
        seqs = [r.seq for r in reqs]
        stop_ids = frozenset().union(*[r.stop_ids for r in reqs])
        return cls(
            reqs,
            DecodeLanes(seqs),
            [seq.table for seq in seqs],
            epoch,
            left=np.array([r.max_output_len - r.num_sampled for r in reqs], dtype=np.int64),
            greedy=all([r.params.argmax_only for r in reqs]),
            ids_only=all(
                [
                    r.detokenizer is None and r.params.logprobs is None and len(r.group) == 1
                    for r in reqs
                ]
            ),
            logprob_rows=logprob_rows(reqs),
            stop_ids=np.fromiter(stop_ids, dtype=np.int64, count=len(stop_ids)),
            request_ids=[r.request_id for r in reqs],
            num_cached_tokens=[r.num_cached_tokens for r in reqs],
        )

    def repeated_inputs(self) -> tuple[np.ndarray, torch.Tensor | None, None]:
        """`ModelRunner.decode`'s inputs when the batch repeats: every input token is in the last
        launch, row for row (placeholder ids, no carried rows)."""
        return np.zeros(len(self.reqs), np.int64), self.tokens, None
