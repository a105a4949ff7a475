"""The requests the memory profile's worst-case step samples for (`ModelRunner.run_worst_case_step`):
stand-ins that drive the engine's own sampler (`Sampler.sample_with_logprobs`) through its most
expensive mode, so the plan measures what a real step of that many rows allocates.

The most expensive mode is every row sampling with temperature, top-k, top-p and min-p, a
``logit_bias`` and ``min_tokens`` (the logits are processed in place), and `MAX_LOGPROBS` logprobs
(the raw log-softmax of every row, and its top-k); and as many rows as the scheduler lets hold KV
with every penalty on, their token-count rows filled from prompts of the longest context (the
rows' allocation and the fill's index tensors).
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import numpy as np
import torch

from radixinfer.cache.kv_manager import SeqKV
from radixinfer.engine.logprobs import MAX_LOGPROBS
from radixinfer.engine.request import Request
from radixinfer.engine.sampler import Sampler
from radixinfer.sampling_params import SamplingParams

FILTERED = SamplingParams(
    max_tokens=2,
    temperature=1.0,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    min_tokens=1,
    logit_bias={0: 1.0, 1: -1.0},
    logprobs=MAX_LOGPROBS,
)
PENALIZED = replace(FILTERED, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)


def worst_case_requests(rows: int, max_penalized: int, prompt_len: int) -> list[Request]:
    """``rows`` stand-in requests, each sampling with every filter, a bias, ``min_tokens`` (against
    stop id 0) and `MAX_LOGPROBS` logprobs; the first ``max_penalized`` with every penalty too, over
    prompts of ``prompt_len`` tokens. They hold no KV: their ``seq`` is a stand-in, which keeps
    their count rows valid until they `leave`."""
    prompt = np.zeros(prompt_len, dtype=np.int64)
    no_kv = cast(SeqKV, object())
    return [
        Request(
            request_id=f"worst case {i}",
            prompt_ids=prompt,
            params=PENALIZED if i < max_penalized else FILTERED,
            salt=None,
            seed=i,
            arrival_index=i,
            detokenizer=None,
            arrival_time=0.0,
            stop_ids=frozenset({0}),
            seq=no_kv,
        )
        for i in range(rows)
    ]


def leave(reqs: list[Request]) -> None:
    """The stand-ins are done: their count rows are free for the next requests (`TokenCounts`
    reclaims the rows of requests whose sequence is gone)."""
    for req in reqs:
        req.seq = None


def sample_worst_case(sampler: Sampler, reqs: list[Request], logits: torch.Tensor) -> None:
    """Sample every row of ``logits [n, vocab]`` for the first ``n`` of ``reqs``, with logprobs, as
    the engine's step does."""
    rows = logits.shape[0]
    sampler.sample_with_logprobs(reqs[:rows], logits, list(range(rows)))
