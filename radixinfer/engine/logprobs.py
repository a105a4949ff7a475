"""Log-probabilities for the requests that ask for them (`SamplingParams.logprobs`,
``prompt_logprobs``), from the model's raw logits: the log-softmax of the logits as the model gives
them, before temperature, penalties or filters (vLLM's default, ``raw_logprobs``).

Only the rows of requests that ask are scored: a step where nobody asks computes nothing here. A
scored row is packed into one float32 row on the device, ``[chosen logprob, chosen rank, k top
logprobs, k top ids]`` (ids and ranks are exact in float32 below 2**24), so its read-back is one
copy riding with the sampled tokens (`radixinfer.engine.pipeline.Launch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixinfer.engine.pipeline import device_index
from radixinfer.outputs import Logprob, PositionLogprobs

if TYPE_CHECKING:
    from radixinfer.engine.prefill_plan import PrefillItem
    from radixinfer.engine.request import Request

TokenText = Callable[[int], str] | None  # a token's text for `Logprob.decoded_token`, or no text
# The most alternatives a request may ask for per position (vLLM's default ``max_logprobs``, and
# OpenAI's limit on ``top_logprobs``): scoring keeps ``[rows, 2 + 2k]`` floats and top-k's
# ``[rows, k]`` values and ids, so the memory plan's worst-case step scores every row at this k.
MAX_LOGPROBS = 20


class ScoredRows(NamedTuple):
    """Rows ``rows`` of a launch, scored: ``packed [len(rows), 2 + 2 * max(ks)]`` (see above)."""

    rows: list[int]
    ks: list[int]
    packed: torch.Tensor


def logprob_rows(reqs: Sequence[Request]) -> list[int]:
    """The rows of ``reqs`` that ask for logprobs of their generated tokens."""
    return [i for i, r in enumerate(reqs) if r.params.logprobs is not None]


class RawLogprobs(NamedTuple):
    """The log-softmax ``logp [len(rows), vocab]`` float32 of rows ``rows`` of a step's logits, and
    ``index``, those rows as a device index."""

    rows: list[int]
    index: torch.Tensor
    logp: torch.Tensor


def raw_logprobs(logits: torch.Tensor, rows: list[int]) -> RawLogprobs:
    """The log-softmax of those rows of ``logits`` (a new tensor: the sampler may change ``logits``
    afterwards)."""
    index = device_index(rows, logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    return RawLogprobs(rows, index, logp)


def score(logp: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Pack each row's chosen token's logprob and rank and its ``max(ks)`` best alternatives.
    ``logp [m, vocab]``, ``chosen [m]`` int64 -> ``[m, 2 + 2 * max(ks)]`` float32."""
    chosen_logp = logp.gather(1, chosen[:, None])  # [m, 1]
    rank = (logp > chosen_logp).sum(dim=1, keepdim=True) + 1  # [m, 1]
    k = max(ks)
    top = logp.topk(k, dim=1) if k else None
    parts = [chosen_logp, rank.float()]
    if top is not None:
        parts += [top.values, top.indices.float()]
    return torch.cat(parts, dim=1)


def score_sampled(raw: RawLogprobs, reqs: Sequence[Request], tokens: torch.Tensor) -> ScoredRows:
    """`score` the sampled ``tokens [len(reqs)]`` of the rows of ``raw``."""
    ks = [reqs[i].params.logprobs for i in raw.rows]
    return ScoredRows(raw.rows, ks, score(raw.logp, tokens.index_select(0, raw.index), ks))


def unpack(row: list[float], chosen: int, k: int, token_text: TokenText) -> PositionLogprobs:
    """One packed row (host floats) as a position's dict: the top ``k`` and the chosen token."""
    width = (len(row) - 2) // 2

    def entry(value: float, rank: int, token: int) -> Logprob:
        return Logprob(value, rank, token_text(token) if token_text is not None else None)

    out = {
        int(row[2 + width + j]): entry(row[2 + j], j + 1, int(row[2 + width + j])) for j in range(k)
    }
    out[chosen] = entry(row[0], int(row[1]), chosen)
    return out


def collect_prompt_logprobs(
    items: list[PrefillItem],
    hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    token_text: TokenText,
    max_rows: int,
) -> None:
    """Append to each item's request the prompt logprobs of the positions the pass computed for it:
    position ``p``'s logits score prompt token ``p + 1``. Items must come from the pass whose
    ``hidden [num_tokens, hidden]`` this is (their ``row`` set); ``token_text`` names the tokens of
    requests that detokenize. Reads back at once (a sync): only requests that asked pay it.

    Positions are scored ``max_rows`` at a time (the rows the memory plan samples at once in a
    pass): a chunk of thousands of positions would otherwise hold its ``[positions, vocab]``
    logits and log-softmax at once, far beyond the plan."""
    for it in items:
        req = it.req
        done = req.prompt_logprobs
        prompt = req.prompt_ids
        first = len(done) - 1  # the next position to score
        last = min(it.end, len(prompt) - 1)  # positions [first, last) score a prompt token
        if first < it.start or last <= first:
            continue
        top_row = it.row - (it.end - 1 - first)  # hidden row of position `first`
        k = req.params.prompt_logprobs
        text = token_text if req.detokenizer is not None else None
        for start in range(first, last, max_rows):
            stop = min(start + max_rows, last)
            rows = hidden[top_row + start - first : top_row + stop - first]
            logp = torch.log_softmax(logits_of(rows).float(), -1)
            targets = prompt[start + 1 : stop + 1]
            packed = score(logp, torch.as_tensor(targets, device=logp.device), [k]).tolist()
            for row, target in zip(packed, targets.tolist()):
                done.append(unpack(row, target, k, text))
