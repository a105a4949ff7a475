"""What the engine hands back: a finished request's output, and a streamed delta."""

from __future__ import annotations

from dataclasses import dataclass


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
