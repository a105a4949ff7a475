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

With a host tier (`HostTier`), a node lives in one of two tiers: GPU-resident (its ``blocks`` are
GPU block ids) or host-resident (``host``: they are host block ids). Eviction writes a GPU node's
tail back to host blocks and keeps it in the tree, host-resident; a match that reaches host-resident
nodes loads them back (`load`). The GPU-resident nodes are closed under parents: a host-resident
node's descendants are all host-resident, so every path is GPU-resident down to some depth, then
host-resident::

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
from sortedcontainers import SortedKeyList

from radixinfer.cache.block_pool import BlockPool
from radixinfer.cache.host_tier import HostTier

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
        "host",
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
        self.host = False  # host-resident: ``blocks`` are host block ids

    @property
    def end(self) -> int:
        return self.start + len(self.key)

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
    """The tree over ``pool`` (GPU blocks) and, when ``host`` is given, a host tier under it."""

    def __init__(self, pool: BlockPool, host: HostTier | None = None) -> None:
        self.pool = pool
        self.host = host
        self.block_size = pool.block_size
        self.counters = TreeCounters()
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._roots: dict[Hashable, Node] = {}
        # Unlocked GPU-frontier nodes (GPU-resident, no GPU-resident child), unlocked host leaves.
        self._evictable = SortedKeyList(key=lambda n: (n.last_access, n.id))
        self._host_evictable = SortedKeyList(key=lambda n: (n.last_access, n.id))
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
        path = path[
            : bisect.bisect_left(ends, length) + 1
        ]  # up to the node holding position length - 1
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
        for child in path:
            blocks[child.start // bs :] = (
                child.blocks
            )  # the child's version of the boundary block wins
        del blocks[-(-length // bs) :]
        node = path[-1]
        payload = node.payload if length == len(tokens) and node.end == length else None
        return MatchResult(length, blocks, node, payload, host_node, host_length)

    def _root(self, salt: Hashable) -> Node:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = Node(as_token_array(()), 0, [], None, next(self._ids))
        return root

    # ------------------------------------------------------------------ locking
    def _lru_set(self, node: Node) -> SortedKeyList | None:
        """The LRU set ``node`` is in while unlocked: the GPU one for a GPU-resident node none of
        whose children is GPU-resident, the host one for a host-resident leaf; None for any other
        node."""
        if node.host:
            return None if node.children else self._host_evictable
        if node.children and (self.host is None or any(not c.host for c in node.children.values())):
            return None
        return self._evictable

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (counts, so nested locks compose)."""
        clock = next(self._clock)
        while node.parent is not None:
            if node.lock_count == 0 and (lru := self._lru_set(node)) is not None:
                lru.discard(node)
            node.lock_count += 1
            node.last_access = clock
            node = node.parent

    def unlock(self, node: Node) -> None:
        clock = next(self._clock)
        while node.parent is not None:
            assert node.lock_count > 0, f"unlock of an unlocked node {node}"
            node.lock_count -= 1
            node.last_access = clock
            if node.lock_count == 0 and (lru := self._lru_set(node)) is not None:
                lru.add(node)
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
        if walked is None:
            walked = self._walk(tokens, self._root(salt))
        assert walked.total_length <= n, "a reused walk must not reach past the inserted tokens"
        node, pos, tree_blocks = walked.node, walked.length, walked.blocks
        if walked.host_node is not None:  # the caller's blocks take the host-resident part's place
            node = self._promote(walked.host_node, walked.host_length, blocks)
            pos, tree_blocks = walked.host_length, self.path_blocks(node)
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
            if node.parent is not None and node.lock_count == 0:
                if (lru := self._lru_set(node)) is not None:
                    lru.discard(node)
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
        upper.host = node.host
        pool = self._pool_of(node)
        pool.incref(upper_blocks)
        lower_dropped = pos // bs - first_index
        pool.decref(node.blocks[:lower_dropped])  # never frees: the upper node holds them now
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
        while node.parent is not None:
            if node.lock_count == 0 and (lru := self._lru_set(node)) is not None:
                lru.discard(node)
                node.last_access = clock
                lru.add(node)
            else:
                node.last_access = clock
            node = node.parent

    def _pool_of(self, node: Node) -> BlockPool:
        return self.host.pool if node.host else self.pool

    # ------------------------------------------------------------------ tiers
    def _retier(self, node: Node, blocks: list[int], host: bool) -> None:
        """Move ``node`` to the other tier, holding ``blocks`` there (their references are taken;
        the caller drops those of the old ones). Its parent's LRU membership changes with it."""
        self.version += 1
        pair = [n for n in (node.parent, node) if n.parent is not None and n.lock_count == 0]
        for n in pair:
            if (lru := self._lru_set(n)) is not None:
                lru.discard(n)
        node.blocks, node.host = blocks, host
        for n in pair:
            if (lru := self._lru_set(n)) is not None:
                lru.add(n)

    def load(self, node: Node, gpu_blocks: list[int]) -> None:
        """Make the host-resident ``node`` (whose parent is GPU-resident) GPU-resident in
        ``gpu_blocks`` (fresh: one reference each, as many as it lists). The host-to-GPU copies are
        queued on the host tier; the node's host blocks are dropped (a split's shared boundary block
        stays with the host-resident child holding it too)."""
        assert node.host and not node.parent.host, f"load of {node}, not the top of a host path"
        bs, fill = self.block_size, self.pool.fill
        for index, block in enumerate(gpu_blocks, start=node.start // bs):
            fill[block] = min(bs, node.end - index * bs)  # its positions arrive with the copy
        host_blocks = node.blocks
        self.host.queue(False, host_blocks, gpu_blocks)
        self._retier(node, gpu_blocks, host=False)
        self.host.pool.decref(host_blocks)
        counters = self.host.counters
        counters.loaded_blocks += len(gpu_blocks)
        counters.loaded_tokens += node.end - node.start

    def _promote(self, host_node: Node, pos: int, blocks: Sequence[int]) -> Node:
        """Make the host-resident path down to position ``pos`` of ``host_node`` GPU-resident in the
        caller's ``blocks`` (a table that stores those positions): nothing is copied. Returns the
        node ending at ``pos``."""
        end = self.split_at(host_node, pos)
        chain, node = [], end
        while node.host:
            chain.append(node)
            node = node.parent
        bs = self.block_size
        for node in reversed(chain):
            gpu_blocks = list(blocks[node.start // bs : -(-node.end // bs)])
            self.pool.incref(gpu_blocks)
            host_blocks = node.blocks
            self._retier(node, gpu_blocks, host=False)
            self.host.pool.decref(host_blocks)
        return end

    def _offload_tail(self, node: Node, num_blocks: int, unwritten: dict[int, int]) -> int | None:
        """Write up to ``num_blocks`` blocks of the GPU-frontier ``node``'s tail back to host blocks
        (making host room by the host tier's own eviction): the tail is split off at a block
        boundary and becomes a host-resident node. Returns the GPU blocks freed, or None when
        nothing could be written back (no host block to be had, or a block whose K/V the forward
        being planned has yet to write, listed in ``unwritten``: block -> slots written)."""
        bs, host_pool = self.block_size, self.host.pool
        count = min(num_blocks, len(node.blocks))
        if host_pool.num_free < count:
            self.evict_host(count - host_pool.num_free)
        count = min(count, host_pool.num_free)
        if count == 0:
            return None
        first_index = (node.end - 1) // bs - count + 1
        for index, block in enumerate(node.blocks[-count:], start=first_index):
            if unwritten.get(block, bs) < min(bs, node.end - index * bs):
                return None
        if first_index * bs > node.start:
            self.split_at(node, first_index * bs)  # ``node`` stays the lower half: the tail
        gpu_blocks = node.blocks
        host_blocks = host_pool.allocate(len(gpu_blocks))
        self.host.queue(True, gpu_blocks, host_blocks)
        self._retier(node, host_blocks, host=True)
        counters = self.host.counters
        counters.offloaded_blocks += len(gpu_blocks)
        counters.offloaded_tokens += node.end - node.start
        return self.pool.decref(gpu_blocks)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_blocks: int, unwritten: dict[int, int] | None = None) -> int:
        """Free up to ``num_blocks`` GPU blocks by trimming unlocked leaves from their tails, block
        by block, least recently used leaf first. A leaf loses its last block and ends at that
        block's start, so the tree keeps every position it does not have to give up; a leaf trimmed
        to nothing is removed, and a parent left an unlocked leaf becomes evictable in turn. Returns
        the blocks freed (a block dropped by the tree is freed only when no live sequence holds it
        too)::

            block_size 4, need 1 block:   leaf [4, 14) "e f g h | i j k l | m n"  blocks [B1, B2, B3]
                                   ->     leaf [4, 12) "e f g h | i j k l"        blocks [B1, B2]   (B3 freed)

        With a host tier the leaves are the GPU frontier's nodes, and a tail is written back instead
        of dropped (`_offload_tail`: as many blocks as are still needed, split off at a block
        boundary): the positions stay in the tree, host-resident. A tail is dropped only when it
        cannot be written back; its host-resident descendants go with it. ``unwritten``: blocks the
        forward being planned writes -> slots written before it (such slots are not written back
        yet).
        """
        freed = 0
        evictable = self._evictable
        while freed < num_blocks and evictable:
            leaf = evictable[0]
            if self.host is not None:
                offloaded = self._offload_tail(leaf, num_blocks - freed, unwritten or {})
                if offloaded is not None:
                    freed += offloaded
                    continue
                if leaf.children:
                    self._drop_host_descendants(leaf)
            freed += self._trim_tail(leaf, self.pool, evictable)
        self.counters.evicted_blocks += freed
        return freed

    def evict_host(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` host blocks by trimming unlocked host-resident leaves from
        their tails, least recently used first, as `evict` does on the GPU. Returns the host blocks
        freed."""
        freed = 0
        evictable = self._host_evictable
        while freed < num_blocks and evictable:
            freed += self._trim_tail(evictable[0], self.host.pool, evictable)
        self.host.counters.host_evicted_blocks += freed
        return freed

    def _trim_tail(self, leaf: Node, pool: BlockPool, lru: SortedKeyList) -> int:
        """Drop the last block of ``leaf`` (the first of ``lru``, a leaf of ``pool``'s tier), or the
        whole leaf when that is its only block. Returns the blocks freed."""
        self.version += 1
        leaf.payload = None  # it belonged to the last position, which goes now (or the leaf does)
        bs = self.block_size
        last_index = (leaf.end - 1) // bs
        if last_index * bs > leaf.start:  # drop its last block: it keeps [start, last_index * bs)
            leaf.key = leaf.key[: last_index * bs - leaf.start]
            return pool.decref([leaf.blocks.pop()])
        lru.pop(0)  # its only block goes: remove the leaf
        freed = pool.decref(leaf.blocks)
        parent = leaf.parent
        del parent.children[int(leaf.key[0])]
        leaf.parent = None
        # a parent in the same tier may have become a leaf of it (a GPU parent of a host leaf stays)
        if parent.parent is not None and parent.lock_count == 0 and parent.host == leaf.host:
            if (parent_lru := self._lru_set(parent)) is not None:
                parent_lru.add(parent)
        return freed

    def _drop_host_descendants(self, node: Node) -> None:
        """Remove every descendant of the unlocked GPU-frontier ``node`` (all host-resident)."""
        self.version += 1
        stack = list(node.children.values())
        node.children.clear()
        freed = 0
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            self._host_evictable.discard(child)
            freed += self.host.pool.decref(child.blocks)
            child.parent, child.payload = None, None
        self.host.counters.host_evicted_blocks += freed

    @property
    def num_evictable_leaves(self) -> int:
        return len(self._evictable)

    @property
    def num_host_evictable_leaves(self) -> int:
        return len(self._host_evictable)

    def reset(self) -> None:
        """Drop every node. The caller guarantees no live sequence holds a lock."""
        for root in self._roots.values():
            for node in self._nodes_below(root):
                assert node.lock_count == 0, f"reset with a locked node {node}"
                self._pool_of(node).decref(node.blocks)
                node.payload = None
        self._roots.clear()
        self._evictable.clear()
        self._host_evictable.clear()
        if self.host is not None:
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

    def path_tokens(self, node: Node) -> TokenArray:
        """Tokens from the root to the end of ``node``."""
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else as_token_array(())

    def path_blocks(self, node: Node) -> list[int]:
        """The block table a reader of ``node``'s whole path uses (deepest version of each block);
        the path must be GPU-resident."""
        assert not node.host, f"GPU blocks of host-resident {node}"
        chain = []
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        blocks: list[int] = []
        for n in reversed(chain):
            del blocks[n.start // self.block_size :]
            blocks.extend(n.blocks)
        return blocks

    def block_holders(self, host: bool = False) -> dict[int, int]:
        """Block id -> number of tree nodes that hold it, of the GPU pool (``host``: of the host
        pool)."""
        holders: dict[int, int] = {}
        for _, node in self.nodes():
            if node.host == host:
                for b in node.blocks:
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
        for host, lru in ((False, self._evictable), (True, self._host_evictable)):
            actual = [n.id for n in lru]
            assert len(actual) == len(set(actual)), f"a node is twice in an LRU set: {actual}"
            assert set(actual) == expected[host], (
                f"{'host' if host else 'GPU'} LRU set {actual} != unlocked leaves {expected[host]}"
            )
