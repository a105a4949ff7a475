"""What the engine hands back: a finished request's output, and what it streams: a delta per request, or the
tokens of a steady decode step as one columnar batch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class RequestOutput:
    """One finished request, in the order the prompts were given to ``generate``.

    ``num_cached_tokens`` counts prompt tokens whose KV came from the prefix cache (never computed for it);
    ``finish_reason`` is ``"length"`` (max_tokens), ``"stop"`` (EOS or a stop token) or ``"abort"``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    finish_reason: str | None


@dataclass(slots=True)
class StreamDelta:
    """New tokens of one request since its previous delta; ``finished`` is set on the last one. Treat it as
    read-only (not frozen only because a frozen dataclass costs 7x more to build, once per token).

    ``timestamp`` is ``time.perf_counter()`` when the tokens left the engine step that produced them.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    timestamp: float


@dataclass(slots=True)
class TokenBatch:
    """One new token for each of several requests, from one engine step, none of them the request's last: what
    a steady decode step yields in place of a `StreamDelta` per request. A 512-wide step would otherwise build,
    route and consume 512 objects a step, under the GIL that the engine thread needs to plan the next step.

    Row ``i`` is request ``request_ids[i]``'s token ``token_ids[i]``; no text (its requests do not detokenize).
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
