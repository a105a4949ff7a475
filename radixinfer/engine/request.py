"""A request's state inside the engine."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from radixinfer.cache.kv_manager import SeqKV
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (holds no blocks)
    PREFILLING = "prefilling"  # admitted, prompt partly computed (chunked prefill)
    RUNNING = "running"  # first token sampled, decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Owned by the engine. ``seq`` is set while the request holds KV blocks (PREFILLING / RUNNING).

    ``prompt_done`` counts prompt positions computed or found cached so far; the prompt is complete when it
    equals ``len(prompt_ids)``.

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
    # `token_array`'s cache and the output length it was built at
    _array: np.ndarray = field(init=False, repr=False)
    _array_outputs: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._array = self.prompt_ids

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
