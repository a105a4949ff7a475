"""The values that pass between a front (`radixinfer.AsyncLLM`) and its engine core, over either
channel (a thread's inbox, or an engine process's pipe), and the sinks a front hands each step's
events to::

    front -> core   AddRequest, Abort, Call, Close          (`CoreInput`)
    core -> front   StepOutput, CoreReady, CoreFailed       (`CoreOutput`)
    front -> sink   one step's events of the sink's requests (`StreamEvents`)

Every message pickles when what it carries does (an engine process sends them over a pipe).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import numpy as np

from radixinfer.api import LLM
from radixinfer.engine.prompts import PromptChecker
from radixinfer.outputs import EngineEvent, StreamDelta, TokenBatch
from radixinfer.sampling_params import SamplingParams

K = TypeVar("K")


@dataclass(frozen=True)
class StreamFailure:
    """Put on a request's sink instead of further deltas when the request cannot go on."""

    request_id: str
    error: BaseException
    # Like a delta's flag: nothing follows it. A consumer of many requests checks
    # ``event.finished`` on every event and tells failures apart only then.
    finished: ClassVar[bool] = True


# ---------------------------------------------------------------------- front -> core
@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt: np.ndarray  # token ids, checked (`PromptChecker.token_ids`)
    params: SamplingParams
    cache_salt: Hashable

    def __reduce__(self) -> tuple:
        # The prompt crosses the pipe as its bytes, and arrives as a read-only array over them (the
        # engine's intake copies it): numpy's own pickling of 1,152 ids costs ~15 us each way in
        # Python-level reduce machinery, as much as the rest of the request's intake.
        prompt = self.prompt
        fields = (self.request_id, prompt.tobytes(), prompt.dtype.str, self.params, self.cache_salt)
        return (_add_request, fields)


def _add_request(
    request_id: str, prompt: bytes, dtype: str, params: SamplingParams, cache_salt: Hashable
) -> AddRequest:
    return AddRequest(request_id, np.frombuffer(prompt, dtype=dtype), params, cache_salt)


@dataclass(slots=True)
class Abort:
    request_id: str  # a request that has finished already is ignored


@dataclass(slots=True)
class Call:
    call_id: int
    fn: Callable[[LLM], Any]  # run between two steps; in an engine process it must pickle


@dataclass(slots=True)
class Close:
    """Abort every open request, report them, and stop."""


CoreInput = AddRequest | Abort | Call | Close


# ---------------------------------------------------------------------- core -> front
@dataclass(slots=True)
class CallResult:
    call_id: int
    value: Any
    error: BaseException | None


@dataclass(slots=True)
class StepOutput:
    """Everything one pass of the loop has for the front. ``num_taken`` counts the `AddRequest`s the
    core has taken so far, ``num_waiting`` the engine's requests queued for admission after the
    step: the front's waiting count is ``submitted - num_taken + num_waiting``."""

    events: list[EngineEvent | StreamFailure]
    results: list[CallResult]
    num_taken: int
    num_waiting: int


@dataclass(frozen=True)
class CoreReady:
    """An engine process has built its `LLM`: what its front needs to check prompts."""

    prompts: PromptChecker


@dataclass(frozen=True)
class CoreFailed:
    """The loop has ended on ``error`` (or its engine process has died); nothing follows."""

    error: BaseException


CoreOutput = StepOutput | CoreReady | CoreFailed


class CoreChannel(Protocol):
    """The core's end of a channel."""

    def take(self, block: bool) -> list[CoreInput]:
        """Every message the front has sent since the last call, in order; with ``block``, waits
        for at least one. A front that has gone away reads as a `Close`."""
        ...

    def emit(self, output: CoreOutput) -> None:
        """Hand ``output`` to the front without waiting for it to be read."""
        ...


# ---------------------------------------------------------------------- front -> sink
StreamEvent = StreamDelta | TokenBatch | StreamFailure
# what a sink receives: one step's events for its requests, in order
StreamEvents = list[StreamEvent]


class Sink(Protocol):
    """Where a step's events of the requests submitted with it go. ``put`` runs on the thread that
    delivers the engine's outputs: it must not block (``queue.SimpleQueue.put`` qualifies)."""

    def put(self, events: StreamEvents) -> None: ...


class _Rows(NamedTuple):
    """Some rows of a repeating decode batch: their indices, and the request ids and cached-token
    counts they hold, which stay the same while the batch repeats."""

    rows: list[int]
    request_ids: list[str]
    num_cached_tokens: list[int]

    def of(self, batch: TokenBatch) -> TokenBatch:
        """These rows of ``batch``, a step of the batch they were taken from."""
        tokens = batch.token_ids
        token_ids = [tokens[row] for row in self.rows]
        return TokenBatch(self.request_ids, token_ids, self.num_cached_tokens, batch.timestamp)


class EventSplitter:
    """Splits each step's events into one list per owner (`split`). A steady decode batch repeats
    step after step (the same request ids, in order: the engine passes the same list on), so the
    split of the last `TokenBatch` is kept and reused while its ids repeat: no look-up per row
    then, and only the new tokens are gathered. That holds because a request keeps its owner while
    it runs: it leaves ``owners`` only when it finishes, and a finished request is in no later
    batch."""

    def __init__(self) -> None:
        self._request_ids: list[str] | None = None  # of the last batch split
        self._parts: dict[Any, _Rows | None] = {}  # its rows by owner; None: every row

    def split(self, events: StreamEvents, owners: dict[str, K]) -> dict[K, StreamEvents]:
        """``events`` as one list per owner (``owners``: request id -> owner, a sink or a front;
        owners hash by identity or value), in order; a `TokenBatch` goes whole to an owner of all
        its rows, else as one batch of its rows per owner. A request that finishes leaves
        ``owners``; events of requests not in ``owners`` (their owner has gone) are dropped."""
        split: dict[K, StreamEvents] = {}
        for event in events:
            if type(event) is TokenBatch:
                for owner, part in self._batch_parts(event, owners).items():
                    split.setdefault(owner, []).append(event if part is None else part.of(event))
                continue
            request_id = event.request_id
            owner = owners.pop(request_id, None) if event.finished else owners.get(request_id)
            if owner is not None:
                split.setdefault(owner, []).append(event)
        return split

    def _batch_parts(self, batch: TokenBatch, owners: dict[str, K]) -> dict[K, _Rows | None]:
        """``batch``'s rows by owner (None: every row), as the last batch's when its ids repeat."""
        if batch.request_ids == self._request_ids:
            return self._parts
        routes = [owners.get(request_id) for request_id in batch.request_ids]
        parts: dict[Any, _Rows | None] = {}
        if routes.count(routes[0]) == len(routes):  # one consumer of many requests: no per-row list
            parts[routes[0]] = None
        else:
            rows: dict[Any, list[int]] = {}
            for row, owner in enumerate(routes):
                rows.setdefault(owner, []).append(row)
            for owner, owner_rows in rows.items():
                part = batch.rows(owner_rows)
                parts[owner] = _Rows(owner_rows, part.request_ids, part.num_cached_tokens)
        parts.pop(None, None)  # rows of requests whose owner has gone
        self._request_ids, self._parts = batch.request_ids, parts
        return parts
