"""What the engine hands back: a finished request's output, and what it streams: a delta per request, or the
tokens of a steady decode step as one columnar batch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class Logprob:
    """A token's log-probability under the model's raw logits, its rank among the vocabulary (1 =
    most likely) and its text (None when the request does not detokenize)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# one position: token id -> its `Logprob` (the chosen token and the top-k alternatives)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's shape): sample ``index`` of ``n``.

    ``finish_reason`` is ``"length"`` (max_tokens), ``"stop"`` (EOS, a stop token or a stop string)
    or ``"abort"``; ``stop_reason`` is the stop string or stop token id that ended it (None for EOS
    and the other reasons). ``logprobs`` has one entry per token of ``token_ids`` when the request
    asked for them (`SamplingParams.logprobs`), else None."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One finished request, in the order the prompts were given to ``generate`` (vLLM's shape):
    ``outputs`` holds its ``n`` completions, in sample order.

    ``num_cached_tokens`` counts prompt tokens whose KV came from the prefix cache (never computed
    for it); ``prompt`` is the prompt's text when it was given as text; ``prompt_logprobs`` has None
    for the first prompt token and a `PositionLogprobs` for each other one when the request asked
    (`SamplingParams.prompt_logprobs`). ``token_ids``, ``text``, ``finish_reason`` and
    ``stop_reason`` are the first completion's, kept as conveniences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason


@dataclass(slots=True)
class StreamDelta:
    """New tokens of one request since its previous delta; ``finished`` is set on the last one. Treat it as
    read-only (not frozen only because a frozen dataclass costs 7x more to build, once per token).

    ``timestamp`` is ``time.perf_counter()`` when the tokens left the engine step that produced them.
    ``index`` is the completion (sample) the tokens belong to, for a request of ``n`` > 1; a
    completion's last delta has its ``finish_reason`` (and ``stop_reason``) set, and ``finished`` is
    set on the request's last delta only, once every completion has ended. ``logprobs``: one
    `PositionLogprobs` per token when the request asked, else None. ``num_cached_tokens``: the
    request's prompt tokens read from the prefix cache; None where they are not known (a benchmark
    backend whose server did not report them, or that has no prefix cache).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int | None
    timestamp: float
    index: int = 0
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class TokenBatch:
    """One new token for each of several requests, from one engine step, none of them the request's last: what
    a steady decode step yields in place of a `StreamDelta` per request. A 512-wide step would otherwise build,
    route and consume 512 objects a step, under the GIL that the engine thread needs to plan the next step.

    Row ``i`` is request ``request_ids[i]``'s token ``token_ids[i]``; no text (its requests do not
    detokenize), no logprobs, one completion each (``index`` 0).
    The lists may be shared with the engine and with other batches (``request_ids`` and ``num_cached_tokens``
    stay the same while a decode batch repeats): read them, never change them.
    """

    request_ids: list[str]
    token_ids: list[int]
    num_cached_tokens: list[int]
    timestamp: float
    finished: ClassVar[bool] = False  # like a delta's flag: a batch never ends a request

    def deltas(self) -> list[StreamDelta]:
        """The same tokens as one `StreamDelta` each, in row order."""
        t = self.timestamp
        return [
            StreamDelta(request_id, [token], "", False, None, cached, t)
            for request_id, token, cached in zip(
                self.request_ids, self.token_ids, self.num_cached_tokens
            )
        ]

    def rows(self, rows: list[int]) -> TokenBatch:
        """A batch of these rows only, in the order given."""
        return TokenBatch(
            [self.request_ids[i] for i in rows],
            [self.token_ids[i] for i in rows],
            [self.num_cached_tokens[i] for i in rows],
            self.timestamp,
        )


EngineEvent = StreamDelta | TokenBatch  # what `LLMEngine.step` returns a list of


def deltas_of(events: Iterable[EngineEvent]) -> Iterator[StreamDelta]:
    """Every event as `StreamDelta`s, in order (a `TokenBatch` as one per row)."""
    for event in events:
        if type(event) is TokenBatch:
            yield from event.deltas()
        else:
            yield event
