"""Which waiting requests join a prefill round (docs/request-lifecycle.md, Admission).

A round admits at most ``max_requests`` requests and ``max_tokens`` *uncached* prompt tokens (a cache hit
costs only its suffix). Policies differ in the order they consider requests and in what they do with one
that does not fit the remaining budget:

- ``fifo``: arrival order; an over-budget request is chunked into what is left (or, with chunking off, runs
  alone when it is first) and ends the round, so nobody overtakes it.
- ``pack``: a lookahead window in arrival order; over-budget requests are skipped so smaller ones fill the
  budget. Every ``force_fifo_every``-th round is a fifo round, so a long prompt is not starved.
- ``lpm``: the window ordered by longest cached prefix first (cache-aware), skipping like ``pack``.

When a skipping policy admits nothing, the window's head is admitted as fifo would (chunked or alone).
Costs are asked for lazily, one candidate at a time, *after* the previous grant was admitted: a request
whose prefix an earlier request of the same round publishes is charged only its own suffix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

POLICIES = ("fifo", "pack", "lpm")


@dataclass(frozen=True)
class AdmissionConfig:
    policy: str = "fifo"
    max_requests: int = 64  # prefill_max_batch_size
    max_tokens: int = 8192  # prefill_max_tokens, in uncached tokens
    chunked_prefill: bool = True
    lookahead: int = 64
    force_fifo_every: int = 0  # 0 = never

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"prefill_admission_policy must be one of {POLICIES}, got {self.policy!r}"
            )
        for name in ("max_requests", "max_tokens", "lookahead"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.force_fifo_every < 0:
            raise ValueError(f"force_fifo_every must be >= 0, got {self.force_fifo_every}")

    def policy_for_round(self, round_index: int) -> str:
        if (
            self.policy != "fifo"
            and self.force_fifo_every
            and round_index % self.force_fifo_every == 0
        ):
            return "fifo"
        return self.policy


@dataclass(frozen=True)
class Grant(Generic[T]):
    """Admit ``item`` and compute ``num_tokens`` of its uncached prompt this round (fewer than its cost when
    chunked)."""

    item: T
    num_tokens: int
    chunked: bool


def plan_admission(
    candidates: Sequence[T],
    config: AdmissionConfig,
    round_index: int,
    cost_of: Callable[[T], int],
    cached_of: Callable[[T], int] | None = None,
    max_requests: int | None = None,
    max_tokens: int | None = None,
) -> Iterator[Grant[T]]:
    """Yield grants for ``candidates`` (in arrival order). ``cost_of`` is called lazily, right before a
    candidate is considered; ``cached_of`` (cached prefix length) orders the ``lpm`` window.
    ``max_requests`` / ``max_tokens`` further cap this round (free batch slots, budget left after chunks
    in progress)."""
    policy = config.policy_for_round(round_index)
    limit = config.max_requests if max_requests is None else min(max_requests, config.max_requests)
    budget = config.max_tokens if max_tokens is None else min(max_tokens, config.max_tokens)
    if limit <= 0 or budget <= 0 or not candidates:
        return
    granted = 0
    if policy == "fifo":
        order: Sequence[T] = candidates
    else:
        order = list(candidates[: config.lookahead])
        if policy == "lpm":
            assert cached_of is not None, "lpm needs cached_of"
            cached = {id(c): cached_of(c) for c in order}
            order = sorted(order, key=lambda c: -cached[id(c)])  # stable: ties keep arrival order
    for cand in order:
        if granted == limit:
            return
        cost = cost_of(cand)
        if cost <= budget:
            budget -= cost
            granted += 1
            yield Grant(cand, cost, chunked=False)
        elif policy != "fifo":
            continue
        else:
            if granted == 0 or (config.chunked_prefill and budget > 0):
                yield _over_budget(cand, cost, budget, config.chunked_prefill)
            return
    if granted == 0:
        head = candidates[0]
        yield _over_budget(head, cost_of(head), budget, config.chunked_prefill)


def _over_budget(cand: T, cost: int, budget: int, chunked_prefill: bool) -> Grant[T]:
    if chunked_prefill and budget < cost:
        return Grant(cand, budget, chunked=True)
    return Grant(cand, cost, chunked=False)
