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
Unlocked leaves are kept in an ordered set by last access (`LRUOrder`), so eviction trims the least
recently used ones (from their tails, by whole blocks) without scanning the tree.

With a host tier (`HostTier`), a node lives in one of two tiers: GPU-resident (its ``blocks`` are
GPU block ids) or host-resident (``host``: they are host block ids). Eviction writes a GPU node's
tail back to host blocks and keeps it in the tree, host-resident; a match that reaches host-resident
nodes loads them back (the moves between tiers: `HostResidency`, the tree's ``tiers``). The
GPU-resident nodes are closed under parents: a host-resident node's descendants are all
host-resident, so every path is GPU-resident down to some depth, then host-resident::

    root -- [a b c d] GPU -- [e f g h] GPU -- [i j k l] host -- [m n] host
                                          +-- [x y] GPU

GPU eviction takes unlocked GPU nodes none of whose children is GPU-resident (the GPU frontier),
least recently used first; the host tier's own eviction trims unlocked host-resident leaves the same
way.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixinfer.cache.block_pool import BlockPool
from radixinfer.cache.host_residency import HostResidency
from radixinfer.cache.host_tier import HostTier
from radixinfer.cache.lru_order import LRUOrder
from radixinfer.cache.tree_node import (
    InsertResult,
    MatchResult,
    Node,
    TokenArray,
    as_token_array,
    common_prefix_len,
    path_blocks,
)


@dataclass
class TreeCounters:
    """Monotonic counters (never decrease, survive `reset`)."""

    evicted_blocks: int = 0


class RadixTree:
    """The tree over ``pool`` (GPU blocks) and, when ``host`` is given, a host tier under it (its
    moves: ``tiers``; ``write_through_hits``: `HostResidency`'s write-through, off when None)."""

    def __init__(
        self, pool: BlockPool, host: HostTier | None = None, write_through_hits: int | None = None
    ) -> None:
        self.pool = pool
        self.host = host
        self.block_size = pool.block_size
        self.counters = TreeCounters()
        self._ids = itertools.count()
        self._roots: dict[Hashable, Node] = {}
        # Unlocked GPU-frontier nodes (GPU-resident, no GPU-resident child), unlocked host leaves.
        self.lru = LRUOrder(two_tiers=host is not None)
        # ``lock(node)`` protects ``node`` and its ancestors from eviction (counts, so nested locks
        # compose); ``unlock(node)`` drops one such lock. `LRUOrder`'s own methods, bound here: a
        # request locks and unlocks a few times, with no call in between.
        self.lock, self.unlock = self.lru.lock, self.lru.unlock
        self.tiers = None if host is None else HostResidency(self, host, write_through_hits)
        # Bumped by every change of what a walk finds (insert, split, evict, reset; not locks or LRU times):
        # a walk taken at the current version is still exact, so callers may reuse it (see `insert`).
        self.version = 0

    # ------------------------------------------------------------------ queries
    def match(self, tokens: TokenArray, salt: Hashable = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` under ``salt``. Changes nothing and counts nothing: a caller
        that uses the blocks locks ``result.node`` (after `split_at` the match length, so the lock pins only
        the blocks it reads) before anything can evict them."""
        return self._walk(tokens, self._root(salt))

    def _walk(self, tokens: TokenArray, root: Node) -> MatchResult:
        """Follow ``tokens`` from ``root``: the deepest node reached, the matched length and the
        blocks covering it (then the host-resident part, if the match goes on into it).

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
            return MatchResult(0, [], root, None)
        keys = path[0].key if len(path) == 1 else np.concatenate([c.key for c in path])
        length = common_prefix_len(keys, tokens)
        # up to the node holding position length - 1
        path = path[: bisect.bisect_left(ends, length) + 1]
        host_node, host_length = None, 0
        if self.host is not None and path[-1].host:  # the host-resident nodes end the path
            first_host = next(i for i, n in enumerate(path) if n.host)
            host_node, host_length = path[-1], length
            length = path[first_host].start
            path = path[:first_host]
            if not path:
                return MatchResult(0, [], root, None, host_node, host_length)
        bs = self.block_size
        blocks: list[int] = []
        for child in path:  # the child's version of the boundary block wins
            blocks[child.start // bs :] = child.blocks
        del blocks[-(-length // bs) :]
        node = path[-1]
        payload = node.payload if length == n and node.end == length else None
        return MatchResult(length, blocks, node, payload, host_node, host_length)

    def _root(self, salt: Hashable) -> Node:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = Node(as_token_array(()), 0, [], None, next(self._ids))
        return root

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
        if walked is None:
            walked = self._walk(tokens, self._root(salt))
        assert walked.total_length <= n, "a reused walk must not reach past the inserted tokens"
        node, pos, tree_blocks = walked.node, walked.length, walked.blocks
        if walked.host_node is not None:  # the caller's blocks take the host-resident part's place
            node = self.tiers.promote(walked.host_node, walked.host_length, blocks)
            pos, tree_blocks = walked.host_length, path_blocks(node, bs)
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
            self.lru.leave([node])  # it stops being a leaf of its tier
            node.children[int(tokens[pos])] = leaf
            node = leaf
            if not lock:
                self.lru.gpu.add(leaf)  # an unlocked leaf
        if lock:
            self.lru.lock(node)
        else:
            self.lru.touch(node)
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
        upper.host = node.host
        pool = self._pool_of(node)
        pool.incref(upper_blocks)
        lower_dropped = pos // bs - first_index
        pool.decref(node.blocks[:lower_dropped])  # never frees: the upper node holds them now
        node.blocks = node.blocks[lower_dropped:]
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        if self.tiers is not None:
            self.tiers.split(node, upper, len(upper_blocks), lower_dropped)
        upper.children[int(node.key[split])] = node
        node.parent.children[int(node.key[0])] = upper
        node.key = node.key[split:].copy()
        node.start = pos
        node.parent = upper
        return upper

    def _pool_of(self, node: Node) -> BlockPool:
        return self.host.pool if node.host else self.pool

    # ------------------------------------------------------------------ eviction
    def evict(self, num_blocks: int, unwritten: dict[int, int] | None = None) -> int:
        """Free up to ``num_blocks`` GPU blocks by trimming unlocked leaves from their tails, least
        recently used leaf first. A leaf loses as many of its last blocks as are still to be freed
        and ends at the first one's start, so the tree keeps every position it does not have to
        give up; a leaf trimmed to nothing is removed, and a parent left an unlocked leaf becomes
        evictable in turn. Returns the blocks freed (a block dropped by the tree is freed only when
        no live sequence holds it too: the next blocks go then)::

            block_size 4, need 1 block:   leaf [4, 14) "e f g h | i j k l | m n"  blocks [B1, B2, B3]
                                   ->     leaf [4, 12) "e f g h | i j k l"        blocks [B1, B2]   (B3 freed)

        With a host tier the leaves are the GPU frontier's nodes, and a tail is written back instead
        of dropped (`HostResidency.offload_tail`: as many blocks as are still needed, split off at a
        block boundary): the positions stay in the tree, host-resident. A tail is dropped only when
        it cannot be written back; its host-resident descendants go with it. ``unwritten``: blocks
        the forward being planned writes -> slots written before it (such slots are not written
        back yet).
        """
        freed = 0
        evictable = self.lru.gpu
        while freed < num_blocks and evictable:
            leaf = evictable[0]
            if self.tiers is not None:
                offloaded = self.tiers.offload_tail(leaf, num_blocks - freed, unwritten or {})
                if offloaded is not None:
                    freed += offloaded
                    continue
                if leaf.children:
                    self.tiers.drop_descendants(leaf)
                self.tiers.forget(leaf)
            self.version += 1
            freed += self.lru.trim_tail(leaf, self.pool, num_blocks - freed)
        self.counters.evicted_blocks += freed
        return freed

    @property
    def num_evictable_leaves(self) -> int:
        return len(self.lru.gpu)

    @property
    def num_host_evictable_leaves(self) -> int:
        return len(self.lru.host)

    def reset(self) -> None:
        """Drop every node. The caller guarantees no live sequence holds a lock."""
        for root in self._roots.values():
            for node in self._nodes_below(root):
                assert node.lock_count == 0, f"reset with a locked node {node}"
                self._pool_of(node).decref(node.blocks)
                node.payload = None
        self._roots.clear()
        self.lru.clear()
        if self.tiers is not None:
            self.tiers.reset()
            self.host.reset()
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

    def block_holders(self, host: bool = False) -> dict[int, int]:
        """Block id -> number of tree nodes that hold it, of the GPU pool (``host``: of the host
        pool, write-through copies included)."""
        held = [node.blocks for _, node in self.nodes() if node.host == host]
        if host and self.tiers is not None:
            held += self.tiers.copies.values()
        holders: dict[int, int] = {}
        for blocks in held:
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        return holders

    def check_integrity(self) -> None:
        """Assert the tree's structural invariants (docs/invariants.md: 5, 8, 9 the tree's
        structure, and 13 the host tier's)."""
        bs = self.block_size
        expected = {False: set(), True: set()}  # tier (host) -> ids of the nodes its LRU set holds
        for _, root in self._roots.items():
            assert root.parent is None and len(root.key) == 0
            for node in self._nodes_below(root):
                parent = node.parent
                assert parent is not None and parent.children.get(int(node.key[0])) is node
                assert len(node.key) > 0, f"empty edge {node}"
                assert node.end == node.start + len(node.key), f"{node}'s end is stale"
                assert node.start == parent.end, f"{node} does not start where its parent ends"
                want = -(-node.end // bs) - node.start // bs
                assert len(node.blocks) == want, (
                    f"{node} holds {len(node.blocks)} blocks, covers {want}"
                )
                child_locks = sum(c.lock_count for c in node.children.values())
                assert node.lock_count >= child_locks, f"{node} has fewer locks than its children"
                assert self.host is not None or not node.host, f"{node} is host-resident"
                assert not parent.host or node.host, f"GPU-resident {node} under a host one"
                pool = self._pool_of(node)
                for b in node.blocks:
                    assert pool.refcount[b] > 0, f"{node} holds free block {b}"
                tier_children = [c for c in node.children.values() if c.host == node.host]
                if not tier_children and node.lock_count == 0:
                    expected[node.host].add(node.id)
        self.lru.check_integrity(expected)
        for node, copy in self.tiers.copies.items() if self.tiers is not None else ():
            assert node.parent is not None and not node.host, f"a copy of {node}"
            assert len(copy) == len(node.blocks), f"{node}'s copy {copy} is not one per block"
