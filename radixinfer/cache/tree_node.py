"""The radix tree's values: a node (one edge and the blocks it holds) and what a match or an
insert returns, with the token-array helpers they share.

A node covering positions ``[start, end)`` holds the blocks with indices ``start // block_size ..
(end - 1) // block_size`` (`radixinfer.cache.radix_tree` draws the boundary block two nodes share).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

TokenArray = np.ndarray  # 1-D int64 token ids


def as_token_array(tokens: Sequence[int] | np.ndarray) -> TokenArray:
    return np.asarray(tokens, dtype=np.int64)


def common_prefix_len(a: TokenArray, b: TokenArray) -> int:
    """Length of the longest common prefix, compared at C speed (no Python loop per token)."""
    n = min(len(a), len(b))
    mismatch = (a[:n] != b[:n]).nonzero()[0]  # the method: `np.flatnonzero` is ~8 Python calls
    return int(mismatch[0]) if mismatch.size else n


class Node:
    """One edge of the tree and the node at its lower end. Kept deliberately small: policy state
    (the LRU sets, write-through hits and copies) lives beside the tree (`LRUOrder`,
    `HostResidency`)."""

    __slots__ = (
        "key",
        "start",
        "end",
        "blocks",
        "children",
        "parent",
        "lock_count",
        "last_access",
        "payload",
        "id",
        "host",
    )

    def __init__(
        self, key: TokenArray, start: int, blocks: list[int], parent: Node | None, node_id: int
    ) -> None:
        self.key = key  # tokens at positions [start, start + len(key))
        self.start = start
        # start + len(key), kept with them (`split_at`, `trim_tail`): read on every walk and
        # admission, where a property's call would cost more than the sum
        self.end = start + len(key)
        self.blocks = blocks  # block ids for indices start // bs .. (end - 1) // bs
        self.children: dict[int, Node] = {}  # first token of the child's key -> child
        self.parent = parent
        self.lock_count = 0  # live sequences whose locked path runs through this node
        self.last_access = 0
        self.payload: Any = None  # final hidden state at position end - 1, set for prompt ends
        self.id = node_id
        self.host = False  # host-resident: ``blocks`` are host block ids

    def __repr__(self) -> str:
        tier = "host" if self.host else "gpu"
        return (
            f"Node(id={self.id}, [{self.start}, {self.end}), {tier} blocks={self.blocks}, "
            f"locks={self.lock_count})"
        )


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a query. ``blocks`` cover positions ``[0, length)``; they are
    valid only while ``node`` (the deepest node the match reaches, possibly partially) is locked.

    ``length``, ``blocks`` and ``node`` are the GPU-resident part of the match. When the match goes
    on through host-resident nodes, ``host_node`` is the deepest of them it reaches (possibly
    partially) and ``host_length`` the whole match's length; otherwise ``host_node`` is None."""

    length: int
    blocks: list[int]
    node: Node
    payload: (
        Any  # the stored final hidden state when the match ends exactly at a prompt end, else None
    )
    host_node: Node | None = None
    host_length: int = 0

    @property
    def total_length(self) -> int:
        """Matched tokens in both tiers."""
        return self.length if self.host_node is None else self.host_length


@dataclass(frozen=True)
class InsertResult:
    """``node`` is the deepest node of the inserted path (ends at or after the path's end).
    ``remap`` lists ``(block_index, tree_block)`` pairs the caller must point its table at before
    releasing its own duplicates (docs/invariants.md, invariant 7). ``new_tokens`` counts tokens
    the tree did not hold before."""

    node: Node
    remap: list[tuple[int, int]]
    new_tokens: int


def path_tokens(node: Node) -> TokenArray:
    """Tokens from the root to the end of ``node``."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return np.concatenate(parts[::-1]) if parts else as_token_array(())


def path_blocks(node: Node, block_size: int) -> list[int]:
    """The block table a reader of ``node``'s whole path uses (deepest version of each block);
    the path must be GPU-resident."""
    assert not node.host, f"GPU blocks of host-resident {node}"
    chain = []
    while node.parent is not None:
        chain.append(node)
        node = node.parent
    blocks: list[int] = []
    for n in reversed(chain):
        del blocks[n.start // block_size :]
        blocks.extend(n.blocks)
    return blocks
