"""A token-level radix tree whose nodes hold references to paged KV blocks.

Edges are labelled by runs of token ids; a node's path from its root is a token prefix. Matching is
token-granular: a match may end mid-edge and mid-block. A node covering positions ``[start, end)`` holds the
blocks with indices ``start // block_size .. (end - 1) // block_size``, so when ``start`` is not block-aligned
the node and its parent both hold a block at index ``start // block_size`` (the *boundary block*)::

    block_size = 4        positions  0 1 2 3 | 4 5 6 7 | 8 9
    parent  [0, 6)  "a b c d | e f"        blocks [B0, B1]
    child   [6, 10)           "g h | i j"  blocks      [B1', B2]

``B1`` and ``B1'`` agree on positions 4..5 (the KV at a position depends only on the tokens before it,
docs/invariants.md, invariant 3) and differ after: a reader that descends into the child uses the deepest node's
version of each block (``B1'``). Each node holds one reference per block it lists.

Each ``cache_salt`` has its own root, so requests with different salts never share a node (invariant 8).
Unlocked leaves are kept in an ordered set by last access, so eviction trims the least recently used ones
(from their tails, block by block) without scanning the tree.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sortedcontainers import SortedKeyList

from radixinfer.cache.block_pool import BlockPool

TokenArray = np.ndarray  # 1-D int64 token ids


def as_token_array(tokens: Sequence[int] | np.ndarray) -> TokenArray:
    return np.asarray(tokens, dtype=np.int64)


def common_prefix_len(a: TokenArray, b: TokenArray) -> int:
    """Length of the longest common prefix, compared at C speed (no Python loop per token)."""
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


class Node:
    """One edge of the tree and the node at its lower end. Kept deliberately small: policy state (the LRU
    set) lives in the tree, not here."""

    __slots__ = (
        "key",
        "start",
        "blocks",
        "children",
        "parent",
        "lock_count",
        "last_access",
        "payload",
        "id",
    )

    def __init__(
        self, key: TokenArray, start: int, blocks: list[int], parent: Node | None, node_id: int
    ) -> None:
        self.key = key  # tokens at positions [start, start + len(key))
        self.start = start
        self.blocks = blocks  # block ids for indices start // bs .. (end - 1) // bs
        self.children: dict[int, Node] = {}  # first token of the child's key -> child
        self.parent = parent
        self.lock_count = 0  # live sequences whose locked path runs through this node
        self.last_access = 0
        self.payload: Any = None  # final hidden state at position end - 1, set for prompt ends
        self.id = node_id

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def __repr__(self) -> str:
        return f"Node(id={self.id}, [{self.start}, {self.end}), blocks={self.blocks}, locks={self.lock_count})"


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a query. ``blocks`` cover positions ``[0, length)``; they are valid only
    while ``node`` (the deepest node the match reaches, possibly partially) is locked."""

    length: int
    blocks: list[int]
    node: Node
    payload: (
        Any  # the stored final hidden state when the match ends exactly at a prompt end, else None
    )


@dataclass(frozen=True)
class InsertResult:
    """``node`` is the deepest node of the inserted path (ends at or after the path's end). ``remap`` lists
    ``(block_index, tree_block)`` pairs the caller must point its table at before releasing its own
    duplicates (docs/invariants.md, invariant 7). ``new_tokens`` counts tokens the tree did not hold before."""

    node: Node
    remap: list[tuple[int, int]]
    new_tokens: int


@dataclass
class TreeCounters:
    """Monotonic counters (never decrease, survive `reset`)."""

    evicted_blocks: int = 0


class RadixTree:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.counters = TreeCounters()
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._roots: dict[Hashable, Node] = {}
        self._evictable = SortedKeyList(key=lambda n: (n.last_access, n.id))
        # Bumped by every change of what a walk finds (insert, split, evict, reset; not locks or LRU times):
        # a walk taken at the current version is still exact, so callers may reuse it (see `insert`).
        self.version = 0

    # ------------------------------------------------------------------ queries
    def match(self, tokens: TokenArray, salt: Hashable = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` under ``salt``. Changes nothing and counts nothing: a caller
        that uses the blocks locks ``result.node`` (after `split_at` the match length, so the lock pins only
        the blocks it reads) before anything can evict them."""
        node, length, blocks = self._walk(tokens, self._root(salt))
        payload = node.payload if length == len(tokens) and node.end == length else None
        return MatchResult(length, blocks, node, payload)

    def _walk(self, tokens: TokenArray, root: Node) -> tuple[Node, int, list[int]]:
        """Follow ``tokens`` from ``root``: (deepest node reached, matched length, blocks covering it).

        Children are picked by their first token alone, then the keys along the picked path are compared
        with ``tokens`` in one vectorised comparison and the path is cut at the first mismatch (a per-edge
        comparison costs microseconds of numpy overhead; a long prompt crosses hundreds of edges)."""
        n = len(tokens)
        path: list[Node] = []
        ends: list[int] = []
        node, pos = root, 0
        while pos < n:
            child = node.children.get(tokens.item(pos))
            if child is None:
                break
            path.append(child)
            node, pos = child, pos + len(child.key)
            ends.append(pos)
        if not path:
            return root, 0, []
        keys = path[0].key if len(path) == 1 else np.concatenate([c.key for c in path])
        length = common_prefix_len(keys, tokens)
        path = path[
            : bisect.bisect_left(ends, length) + 1
        ]  # up to the node holding position length - 1
        bs = self.block_size
        blocks: list[int] = []
        for child in path:
            blocks[child.start // bs :] = (
                child.blocks
            )  # the child's version of the boundary block wins
        del blocks[-(-length // bs) :]
        return path[-1], length, blocks

    def _root(self, salt: Hashable) -> Node:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = Node(as_token_array(()), 0, [], None, next(self._ids))
        return root

    # ------------------------------------------------------------------ locking
    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (counts, so nested locks compose)."""
        clock = next(self._clock)
        evictable = self._evictable
        while node.parent is not None:
            if node.lock_count == 0 and not node.children:
                evictable.discard(node)
            node.lock_count += 1
            node.last_access = clock
            node = node.parent

    def unlock(self, node: Node) -> None:
        clock = next(self._clock)
        while node.parent is not None:
            assert node.lock_count > 0, f"unlock of an unlocked node {node}"
            node.lock_count -= 1
            node.last_access = clock
            if node.lock_count == 0 and not node.children:
                self._evictable.add(node)
            node = node.parent

    # ------------------------------------------------------------------ insertion
    def insert(
        self,
        tokens: TokenArray,
        blocks: Sequence[int],
        salt: Hashable = None,
        *,
        end_node: bool = False,
        walked: MatchResult | None = None,
        lock: bool = False,
    ) -> InsertResult:
        """Insert the path ``tokens`` whose KV lives in ``blocks`` (a sequence's block table covering at least
        ``len(tokens)`` positions). New nodes take a reference on the blocks they list.

        Full blocks the tree already holds for this path come back in ``remap``; the boundary block where
        the path leaves the tree is never remapped (the caller may still write past the shared part).
        With ``end_node`` a node is split so one ends exactly at ``len(tokens)`` (to carry a payload).

        ``walked``: the walk of ``tokens`` from the root, taken earlier at the current `version` (a request
        publishing the prompt it was just admitted with does not walk its ~1,000 tokens again; which earlier
        walks stand for this one: `TreeWalk`).
        ``lock``: also `lock` the returned node (a new leaf then does not enter the LRU set only to leave it).
        """
        bs = self.block_size
        n = len(tokens)
        self.version += 1
        if walked is not None:
            assert walked.length <= n, "a reused walk must not reach past the inserted tokens"
            node, pos, tree_blocks = walked.node, walked.length, walked.blocks
        else:
            node, pos, tree_blocks = self._walk(tokens, self._root(salt))
        if pos < n or end_node:
            node = self.split_at(node, pos)
        full = pos // bs
        remap = (
            []
            if list(blocks[:full]) == tree_blocks[:full]
            else [  # equal (one C comparison): the usual case
                (k, tb) for k, tb in enumerate(tree_blocks[:full]) if blocks[k] != tb
            ]
        )
        new_tokens = n - pos
        if new_tokens:
            leaf_blocks = list(blocks[pos // bs : -(-n // bs)])
            self.pool.incref(leaf_blocks)
            leaf = Node(tokens[pos:n].copy(), pos, leaf_blocks, node, next(self._ids))
            if node.parent is not None and node.lock_count == 0 and not node.children:
                self._evictable.discard(node)
            node.children[int(tokens[pos])] = leaf
            node = leaf
            if not lock:
                self._evictable.add(leaf)  # an unlocked leaf
        if lock:
            self.lock(node)
        else:
            self._touch(node)
        return InsertResult(node, remap, new_tokens)

    def attach_payload(self, node: Node, payload: Any) -> None:
        """Store ``payload`` (a prompt's final hidden state) on ``node``; walks report it from now on."""
        node.payload = payload
        self.version += 1

    def split_at(self, node: Node, pos: int) -> Node:
        """Return a node ending exactly at ``pos`` on ``node``'s path (``node.start < pos <= node.end``),
        splitting ``node`` if ``pos`` is inside its edge. The existing object stays the lower half (handles to
        it stay valid); a new upper node is made, with ``node``'s locks and access time.

        A lock on the upper half pins only the blocks of positions ``[0, pos)``: admission splits a partial
        match this way, so a request that reads 5 tokens of a cached 40-token edge does not pin all 40."""
        if pos == node.end:
            return node
        self.version += 1
        bs = self.block_size
        split = pos - node.start
        first_index = node.start // bs
        upper_blocks = node.blocks[: -(-pos // bs) - first_index]
        upper = Node(node.key[:split], node.start, upper_blocks, node.parent, next(self._ids))
        self.pool.incref(upper_blocks)
        lower_dropped = pos // bs - first_index
        self.pool.decref(node.blocks[:lower_dropped])  # never frees: the upper node holds them now
        node.blocks = node.blocks[lower_dropped:]
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        upper.children[int(node.key[split])] = node
        node.parent.children[int(node.key[0])] = upper
        node.key = node.key[split:].copy()
        node.start = pos
        node.parent = upper
        return upper

    def _touch(self, node: Node) -> None:
        """Mark ``node``'s path as just used (LRU order)."""
        clock = next(self._clock)
        evictable = self._evictable
        while node.parent is not None:
            if node.lock_count == 0 and not node.children:
                evictable.discard(node)
                node.last_access = clock
                evictable.add(node)
            else:
                node.last_access = clock
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks by trimming unlocked leaves from their tails, block by block, least
        recently used leaf first. A leaf loses its last block and ends at that block's start, so the tree keeps
        every position it does not have to give up; a leaf trimmed to nothing is removed, and a parent left an
        unlocked leaf becomes evictable in turn. Returns the blocks freed (a block dropped by the tree is freed
        only when no live sequence holds it too)::

            block_size 4, need 1 block:   leaf [4, 14) "e f g h | i j k l | m n"  blocks [B1, B2, B3]
                                   ->     leaf [4, 12) "e f g h | i j k l"        blocks [B1, B2]   (B3 freed)
        """
        freed = 0
        evictable = self._evictable
        bs = self.block_size
        while freed < num_blocks and evictable:
            leaf = evictable[0]
            self.version += 1
            leaf.payload = (
                None  # it belonged to the last position, which goes now (or the whole leaf does)
            )
            last_index = (leaf.end - 1) // bs
            if last_index * bs <= leaf.start:  # its only block goes: remove the leaf
                evictable.pop(0)
                freed += self.pool.decref(leaf.blocks)
                parent = leaf.parent
                del parent.children[int(leaf.key[0])]
                leaf.parent = None
                if parent.parent is not None and not parent.children and parent.lock_count == 0:
                    evictable.add(parent)
            else:  # drop its last block: it keeps positions [start, last_index * bs)
                freed += self.pool.decref([leaf.blocks.pop()])
                leaf.key = leaf.key[: last_index * bs - leaf.start]
        self.counters.evicted_blocks += freed
        return freed

    @property
    def num_evictable_leaves(self) -> int:
        return len(self._evictable)

    def reset(self) -> None:
        """Drop every node. The caller guarantees no live sequence holds a lock."""
        for root in self._roots.values():
            for node in self._nodes_below(root):
                assert node.lock_count == 0, f"reset with a locked node {node}"
                self.pool.decref(node.blocks)
                node.payload = None
        self._roots.clear()
        self._evictable.clear()
        self.version += 1

    # ------------------------------------------------------------------ inspection
    def _nodes_below(self, root: Node) -> list[Node]:
        out, stack = [], list(root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def nodes(self) -> list[tuple[Hashable, Node]]:
        """Every non-root node with its salt (for tests and integrity checks; walks the whole tree)."""
        return [
            (salt, node) for salt, root in self._roots.items() for node in self._nodes_below(root)
        ]

    def path_tokens(self, node: Node) -> TokenArray:
        """Tokens from the root to the end of ``node``."""
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else as_token_array(())

    def path_blocks(self, node: Node) -> list[int]:
        """The block table a reader of ``node``'s whole path uses (deepest version of each block)."""
        chain = []
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        blocks: list[int] = []
        for n in reversed(chain):
            del blocks[n.start // self.block_size :]
            blocks.extend(n.blocks)
        return blocks

    def block_holders(self) -> dict[int, int]:
        """Block id -> number of tree nodes that hold it."""
        holders: dict[int, int] = {}
        for _, node in self.nodes():
            for b in node.blocks:
                holders[b] = holders.get(b, 0) + 1
        return holders

    def check_integrity(self) -> None:
        """Assert the tree's structural invariants (docs/invariants.md: 5, 8 and 9, the tree's structure)."""
        bs = self.block_size
        expected_evictable = set()
        for _, root in self._roots.items():
            assert root.parent is None and len(root.key) == 0
            for node in self._nodes_below(root):
                parent = node.parent
                assert parent is not None and parent.children.get(int(node.key[0])) is node
                assert len(node.key) > 0, f"empty edge {node}"
                assert node.start == parent.end, f"{node} does not start where its parent ends"
                want = -(-node.end // bs) - node.start // bs
                assert len(node.blocks) == want, (
                    f"{node} holds {len(node.blocks)} blocks, covers {want}"
                )
                child_locks = sum(c.lock_count for c in node.children.values())
                assert node.lock_count >= child_locks, f"{node} has fewer locks than its children"
                for b in node.blocks:
                    assert self.pool.refcount[b] > 0, f"{node} holds free block {b}"
                if not node.children and node.lock_count == 0:
                    expected_evictable.add(node.id)
        actual = {n.id for n in self._evictable}
        assert actual == expected_evictable, (
            f"evictable set {actual} != unlocked leaves {expected_evictable}"
        )
