"""User-facing sampling parameters, validated on construction so bad input never reaches the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixinfer.checks import flag, integer, real, wrong_type

SEED_LIMIT = 2**64  # seeds are unsigned 64-bit integers
TOP_K_LIMIT = 2**31  # a top-k this large keeps every token of any vocabulary


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` is greedy; ``top_k`` of 0 or -1 (vLLM's spelling)
    and ``top_p == 1`` disable those filters; ``seed`` (an unsigned 64-bit integer) makes a request's
    samples independent of the batch it runs in. ``detokenize=False`` streams and returns token ids only
    (``text`` stays empty): a client that consumes ids (a benchmark, a front end that detokenizes
    elsewhere) does not pay the per-token incremental detokenization that otherwise runs on the engine's
    thread (vLLM's option of the same name).

    Holds after construction: every field has its annotated type (numpy integers and floats become
    Python ones, ``top_k == -1`` becomes 0, ``stop_token_ids`` a tuple). Raises ``ValueError`` naming the
    field on any invalid value. Stop token ids past the model's vocabulary are refused when the request
    is added (`LLMEngine.add_request`), where the vocabulary is known.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | None = field(default=None)
    detokenize: bool = True

    def __post_init__(self) -> None:
        checked = {
            "max_tokens": integer("max_tokens", self.max_tokens, 1),
            "temperature": real("temperature", self.temperature),
            "top_p": real("top_p", self.top_p),
            "top_k": max(integer("top_k", self.top_k, -1, TOP_K_LIMIT), 0),
            "seed": None if self.seed is None else integer("seed", self.seed, 0, SEED_LIMIT),
            "ignore_eos": flag("ignore_eos", self.ignore_eos),
            "stop_token_ids": self._checked_stop_token_ids(),
            "detokenize": flag("detokenize", self.detokenize),
        }
        if checked["temperature"] < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < checked["top_p"] <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def _checked_stop_token_ids(self) -> tuple[int, ...] | None:
        ids = self.stop_token_ids
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)):
            raise wrong_type("stop_token_ids", "a list of token ids", ids)
        return tuple(integer(f"stop_token_ids[{i}]", token_id, 0) for i, token_id in enumerate(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
