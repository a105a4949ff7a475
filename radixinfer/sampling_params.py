"""User-facing sampling parameters, validated on construction so bad input never reaches the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable
    those filters; ``seed`` makes a request's samples independent of the batch it runs in. ``detokenize=False``
    streams and returns token ids only (``text`` stays empty): a client that consumes ids (a benchmark, a
    front end that detokenizes elsewhere) does not pay the per-token incremental detokenization that otherwise
    runs on the engine's thread (vLLM's option of the same name).

    Raises ``ValueError`` naming the field on any invalid value.
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
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
