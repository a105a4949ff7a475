"""Where a data-parallel front (`radixinfer.data_parallel.DataParallelLLM`) sends each request:
`Router`, plain bookkeeping over the replicas' loads and the prompts each replica has in flight.

Policies (`POLICIES`):

- ``cache_aware`` (the default): the replica holding the longest prefix of the prompt (under the
  request's cache salt), among the replicas at most ``load_margin`` requests busier than the least
  loaded; the least loaded when no such replica holds any of it. A replica's prefix is the longer
  of what its radix tree holds (asked of the replica itself: exact) and what its requests in
  flight share with the prompt (counted here, in whole chunks of ``chunk_tokens``): requests
  routed since the tree was asked are in no tree yet, and a burst's first requests find every tree
  empty, so without them a burst's groups would be spread over every replica.
- ``round_robin``: replica 0, 1, ..., M - 1, 0, ...
- ``least_loaded``: the replica with the fewest requests in flight.

A replica's load is its requests in flight: routed and not finished (waiting or running there), as
the router counts them (exact, and free to read). Ties go to the replica after the last one chosen,
so equal replicas take turns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Hashable, Sequence

import numpy as np

POLICIES = ("cache_aware", "round_robin", "least_loaded")


def prefix_keys(tokens: np.ndarray, salt: Hashable, chunk_tokens: int) -> list[int]:
    """One key per whole chunk of ``tokens``: key ``k`` names the salt and the first ``k + 1``
    chunks (each chained onto the one before), so two prompts share key ``k`` exactly when they
    share the salt and the first ``(k + 1) * chunk_tokens`` tokens (up to hash collisions)."""
    key = hash(("radixinfer-prefix", salt))
    keys = []
    data = np.ascontiguousarray(tokens, dtype=np.int64)
    for start in range(0, len(data) - chunk_tokens + 1, chunk_tokens):
        key = hash((key, data[start : start + chunk_tokens].tobytes()))
        keys.append(key)
    return keys


class Router:
    """Chooses a replica for each request (`place`) and forgets it when it ends (`release`). Not
    thread-safe: its owner serialises the calls.

    What must hold: ``loads[r]`` is the number of requests placed on ``r`` and not released, and
    the in-flight prefix counts of ``r`` are those of exactly those requests."""

    def __init__(
        self, num_replicas: int, policy: str, load_margin: int, chunk_tokens: int = 16
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.set_policy(policy)
        if load_margin < 0:
            raise ValueError(f"load_margin must be >= 0, got {load_margin}")
        self.num_replicas = num_replicas
        self.load_margin = load_margin
        self.chunk_tokens = chunk_tokens
        self.loads = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests placed on each replica so far
        self._in_flight: list[Counter[int]] = [Counter() for _ in range(num_replicas)]
        self._last = num_replicas - 1

    def set_policy(self, policy: str) -> None:
        """Place later requests by ``policy`` (the books of those in flight are kept)."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy

    @property
    def needs_trees(self) -> bool:
        """Whether `place` reads the replicas' trees (``cached`` must then be given): with
        ``cache_aware`` and more than one replica."""
        return self.policy == "cache_aware" and self.num_replicas > 1

    def place(
        self,
        tokens: np.ndarray,
        salt: Hashable,
        cached: Sequence[int] | None = None,
        down: Collection[int] = (),
    ) -> tuple[int, list[int]]:
        """The replica for a prompt of ``tokens`` under ``salt``, never one of ``down`` (replicas
        that have failed), and the keys to hand back to `release`. ``cached[r]``: how many leading
        tokens replica ``r``'s tree holds (``cache_aware`` only). ``RuntimeError`` when every
        replica is down."""
        up = [r for r in range(self.num_replicas) if r not in down]
        if not up:
            raise RuntimeError("every data-parallel replica has failed")
        keys = prefix_keys(tokens, salt, self.chunk_tokens) if self.needs_trees else []
        if self.policy == "round_robin":
            replica = self._after_last(up)
        elif self.policy == "least_loaded":
            replica = self._least_loaded(up)
        else:
            replica = self._cache_aware(up, keys, cached)
        self._last = replica
        self.loads[replica] += 1
        self.routed[replica] += 1
        self._in_flight[replica].update(keys)
        return replica, keys

    def release(self, replica: int, keys: list[int]) -> None:
        """A request placed on ``replica`` with ``keys`` has ended."""
        self.loads[replica] -= 1
        counts = self._in_flight[replica]
        counts.subtract(keys)
        for key in keys:
            if counts[key] <= 0:
                del counts[key]

    def in_flight_prefix(self, replica: int, keys: list[int]) -> int:
        """Leading tokens of the prompt of ``keys`` that a request in flight on ``replica`` shares
        (whole chunks)."""
        counts = self._in_flight[replica]
        shared = 0
        for key in keys:
            if key not in counts:
                break
            shared += 1
        return shared * self.chunk_tokens

    def _turn(self, replica: int) -> int:
        """How far ``replica`` comes after the last one chosen (ties go to the nearest)."""
        return (replica - self._last - 1) % self.num_replicas

    def _after_last(self, up: list[int]) -> int:
        return min(up, key=self._turn)

    def _least_loaded(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda r: (self.loads[r], self._turn(r)))

    def _cache_aware(self, up: list[int], keys: list[int], cached: Sequence[int] | None) -> int:
        if len(up) == 1:
            return up[0]
        if cached is None:
            raise ValueError("cache_aware routing needs every replica's cached prefix length")
        least = min(self.loads[r] for r in up)
        eligible = [r for r in up if self.loads[r] <= least + self.load_margin]
        hits = {r: max(cached[r], self.in_flight_prefix(r, keys)) for r in eligible}
        best = max(hits.values())
        if best == 0:
            return self._least_loaded(eligible)
        return self._least_loaded([r for r in eligible if hits[r] == best])
