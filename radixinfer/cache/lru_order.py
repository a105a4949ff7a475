"""The radix tree's eviction order: the unlocked leaves of each tier by last access, and the
trimming of a leaf's tail by whole blocks.

A node is in the GPU set while it is unlocked, GPU-resident and none of its children is
GPU-resident (the GPU frontier; without a host tier, a leaf); in the host set while it is unlocked,
host-resident and a leaf; in neither otherwise. Eviction takes the first node of a set (least
recently used, oldest node first among equals) without scanning the tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from sortedcontainers import SortedKeyList

from radixinfer.cache.block_pool import BlockPool
from radixinfer.cache.tree_node import Node


def _lru_key(node: Node) -> tuple[int, int]:
    return node.last_access, node.id


class LRUOrder:
    """Both tiers' sets of evictable nodes (``gpu``, ``host``) and the access clock; ``two_tiers``:
    a host tier is under the GPU pool (a GPU node with only host-resident children is then on the
    frontier). Locking and touching a node go through here, as they change its place."""

    def __init__(self, two_tiers: bool) -> None:
        self.two_tiers = two_tiers
        self.gpu = SortedKeyList(key=_lru_key)
        self.host = SortedKeyList(key=_lru_key)
        self._clock = itertools.count(1)

    def set_of(self, node: Node) -> SortedKeyList | None:
        """The set ``node`` is in while unlocked (the module says which), or None."""
        if node.host:
            return None if node.children else self.host
        if node.children and (
            not self.two_tiers or any(not c.host for c in node.children.values())
        ):
            return None
        return self.gpu

    def lock(self, node: Node) -> None:
        """Count a lock on ``node`` and its ancestors (they leave their sets) and mark them used."""
        clock = next(self._clock)
        while node.parent is not None:
            if node.lock_count == 0 and (lru := self.set_of(node)) is not None:
                lru.discard(node)
            node.lock_count += 1
            node.last_access = clock
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Drop one lock of ``node`` and its ancestors (those left unlocked join their sets)."""
        clock = next(self._clock)
        while node.parent is not None:
            assert node.lock_count > 0, f"unlock of an unlocked node {node}"
            node.lock_count -= 1
            node.last_access = clock
            if node.lock_count == 0 and (lru := self.set_of(node)) is not None:
                lru.add(node)
            node = node.parent

    def touch(self, node: Node) -> None:
        """Mark ``node``'s path as just used."""
        clock = next(self._clock)
        while node.parent is not None:
            if node.lock_count == 0 and (lru := self.set_of(node)) is not None:
                lru.discard(node)
                node.last_access = clock
                lru.add(node)
            else:
                node.last_access = clock
            node = node.parent

    def leave(self, nodes: Iterable[Node]) -> list[Node]:
        """Take the unlocked non-root ``nodes`` out of their sets before a change of their children
        or tier; returns them, for `enter` after the change."""
        moved = [n for n in nodes if n.parent is not None and n.lock_count == 0]
        for n in moved:
            if (lru := self.set_of(n)) is not None:
                lru.discard(n)
        return moved

    def enter(self, nodes: Iterable[Node]) -> None:
        """Put ``nodes`` (taken out by `leave`) into the sets they belong in now."""
        for n in nodes:
            if (lru := self.set_of(n)) is not None:
                lru.add(n)

    def trim_tail(self, leaf: Node, pool: BlockPool, num_blocks: int = 1) -> int:
        """Drop the last ``num_blocks >= 1`` blocks of ``leaf`` (the first of its tier's set;
        ``pool`` is that tier's), or the whole leaf when that is all of them; a parent of the same
        tier left evictable joins its set. Returns the blocks freed (fewer than dropped where a live
        sequence holds some too). The caller bumps the tree's version.

        Dropping k blocks at once ends where k calls of one block each would (the leaf's place in
        its set does not change while it keeps blocks), in one call where evicting a finished
        request's ~64 blocks took 64."""
        leaf.payload = None  # it belonged to the last position, which goes now (or the leaf does)
        bs = pool.block_size
        blocks = leaf.blocks
        # its first block holds ``start``: that one goes only with the whole leaf
        keep = len(blocks) - num_blocks
        if keep > 0:  # it keeps [start, the end of its first ``keep`` blocks)
            end = (leaf.start // bs + keep) * bs
            leaf.key = leaf.key[: end - leaf.start]
            leaf.end = end
            dropped = blocks[keep:]
            del blocks[keep:]
            return pool.decref(dropped)
        (self.host if leaf.host else self.gpu).pop(0)  # all its blocks go: remove the leaf
        freed = pool.decref(leaf.blocks)
        parent = leaf.parent
        del parent.children[int(leaf.key[0])]
        leaf.parent = None
        # a parent in the same tier may have become a leaf of it (a GPU parent of a host leaf stays)
        if parent.parent is not None and parent.lock_count == 0 and parent.host == leaf.host:
            self.enter([parent])
        return freed

    def clear(self) -> None:
        self.gpu.clear()
        self.host.clear()

    def check_integrity(self, expected: dict[bool, set[int]]) -> None:
        """Assert each set holds exactly the nodes of ``expected`` (host -> ids of the unlocked
        leaves of that tier, as the tree counts them), each once."""
        for host, lru in ((False, self.gpu), (True, self.host)):
            actual = [n.id for n in lru]
            assert len(actual) == len(set(actual)), f"a node is twice in an LRU set: {actual}"
            assert set(actual) == expected[host], (
                f"{'host' if host else 'GPU'} LRU set {actual} != unlocked leaves {expected[host]}"
            )
