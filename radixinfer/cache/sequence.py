"""The values the sequence side of the cache hands out: a live sequence's state (`SeqKV`), a kept
tree walk (`TreeWalk`) and what a `reserve` planned (`ReservePlan`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixinfer.cache.radix_tree import MatchResult, Node


@dataclass(eq=False)
class SeqKV:
    """A live sequence's cache state. ``table[i]`` holds positions ``i*block_size ..``; positions
    ``[0, num_kv)`` have KV stored (or scheduled to be stored by the current step) in the table's
    slots."""

    salt: Hashable
    table: list[int]
    num_kv: int
    num_cached: int  # prompt tokens found in the cache at admission
    payload: Any  # the final hidden state cached for an exact repeat of the prompt, else None
    node: Node | None  # the locked tree node, or None
    released: bool = False
    # The admission walk: the first `publish` reuses it while it stands for the published path.
    match: TreeWalk | None = None
    num_loaded: int = 0  # of `num_cached`, tokens loaded back from the host tier at admission


@dataclass(frozen=True)
class TreeWalk:
    """A walk of a query of ``query_len`` tokens from the root, taken at tree ``version``, kept so a
    later step need not walk again: the policy's peek for the admission, the admission match for the
    first publish.

    While the tree is unchanged it is also the walk of a path that starts with the query's first
    ``min(n, query_len)`` tokens, for a path of ``n`` tokens where either ``n <= query_len`` (the
    walk of a prefix stops where the query's did, or earlier) or the query's walk stopped short of
    its end (the tree diverges there, so tokens past the query cannot extend it). A path that goes
    on past a query the tree matched to its end may go on matching: it must be walked."""

    result: MatchResult
    query_len: int
    version: int

    def walk_of(self, n: int, version: int) -> MatchResult | None:
        """The walk of the sequence's first ``n`` tokens at tree ``version``, when this one stands
        for it."""
        result = self.result
        length = result.total_length  # through host-resident nodes too
        if version != self.version or length > n:
            return None
        return result if n <= self.query_len or length < self.query_len else None


@dataclass(frozen=True)
class ReservePlan:
    """Slots to write, in order (per sequence, its positions ``old num_kv .. new num_kv - 1``), the
    block copies ``(src, dst)`` to perform before those writes, and which sequences' block tables
    changed (their indices in the call, ascending): they took a fresh block or copied their boundary
    block. `reserve_step` gives the slots as an int64 array."""

    slots: list[int] | np.ndarray
    copies: list[tuple[int, int]]
    changed: list[int]
