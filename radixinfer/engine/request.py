"""A request's state inside the engine."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from radixinfer.cache.kv_manager import SeqKV
from radixinfer.engine.stop_strings import StopStrings
from radixinfer.outputs import PositionLogprobs
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (holds no blocks)
    PREFILLING = "prefilling"  # admitted, prompt partly computed (chunked prefill)
    RUNNING = "running"  # first token sampled, decoding
    FORKING = "forking"  # a further sample of an n > 1 request: waits for its first sample's prompt
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # slots: its fields are read and set all along the step's path
class Request:
    """Owned by the engine. ``seq`` is set while the request holds KV blocks (PREFILLING / RUNNING).

    ``prompt_done`` counts prompt positions computed or found cached so far; the prompt is complete when it
    equals ``len(prompt_ids)``.

    A request of ``n`` > 1 completions is a ``group`` of ``n`` requests (sample ``index`` 0 to
    n - 1, one list shared by all, sample 0 first): sample 0 is queued and prefills; the others wait in
    ``FORKING`` until its prompt is complete, then share its KV (`Scheduler.fork`) and decode on
    their own. The engine knows a request by sample 0; the group has finished when every sample has.

    ``text`` is the completion's text so far (a stop string cut off), ``sent`` how much of it has
    been streamed.

    The prompt is kept as an int64 array, never as a list: the garbage collector walks every element of a live
    list on each full collection, and 512 prompts of 1,152 ids as lists made each such pause ~7 ms longer.
    """

    request_id: str
    prompt_ids: np.ndarray  # int64 (validation converts the prompt once)
    params: SamplingParams
    salt: Hashable
    seed: int  # the sampling seed: params.seed, or one drawn from the engine's seed
    arrival_index: int
    detokenizer: IncrementalDetokenizer | None  # None: params.detokenize is off, text stays empty
    arrival_time: float
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    seq: SeqKV | None = None
    prompt_done: int = 0
    # Set at its first successful admission: prompt tokens read from the prefix cache, never computed for it.
    # With the prompt complete, ``num_cached_tokens + num_computed_prompt_tokens == len(prompt_ids)``.
    num_cached_tokens: int | None = None
    num_computed_prompt_tokens: int = 0
    num_host_hit_tokens: int = 0  # of `num_cached_tokens`, loaded back from the host tier
    finish_reason: str | None = None
    stop_ids: frozenset[int] = frozenset()
    # Tokens sampled so far, read back or still on the device (the host reads a step's tokens a step later;
    # `radixinfer.engine.pipeline` knows where the newest one is until then).
    num_sampled: int = 0
    max_output_len: int = 0  # max_tokens, capped so prompt + output fit the model's context
    text: str = ""
    sent: int = 0
    index: int = 0
    group: list[Request] = None  # type: ignore[assignment]  # set in __post_init__ when not given
    stop_strings: StopStrings | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None  # per output token, when params.logprobs is set
    # None for the first prompt token, then one per prompt token computed so far
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # `token_array`'s cache and the output length it was built at
    _array: np.ndarray = field(init=False, repr=False)
    _array_outputs: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._array = self.prompt_ids
        if self.group is None:  # a request of one sample
            self.group = [self]

    def group_finished(self) -> bool:
        """Whether every sample of the request's group has finished."""
        for r in self.group:  # (a loop: a generator costs a call per sample, once per request)
            if r.status is not Status.FINISHED:
                return False
        return True

    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked for and not all computed yet (so the prompt is
        computed, not read from the cache)."""
        done = self.prompt_logprobs
        return done is not None and len(done) < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_array(self) -> np.ndarray:
        """The prompt then the output so far, as an int64 array, extended only when the output has grown:
        admission matches, publishes and slices the same prompt several times a round, release publishes it
        once more, and converting ~1,000 Python ints costs ~25 µs."""
        built, out = self._array_outputs, self.output_ids
        if built != len(out):  # the output only grows: convert just the new tokens
            self._array = np.concatenate([self._array, np.asarray(out[built:], dtype=np.int64)])
            self._array_outputs = len(out)
        return self._array
