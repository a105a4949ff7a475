"""The radix tree's moves between tiers: writing a GPU node's tail back to host blocks, loading a
host-resident node back, promoting a host-resident path into a caller's blocks, and the host tier's
own LRU eviction.

A node lives in one of two tiers: GPU-resident (its ``blocks`` are GPU block ids) or host-resident
(``host``: they are host block ids), and the GPU-resident nodes are closed under parents
(`radixinfer.cache.radix_tree` draws the picture). Every move keeps that: an offload takes the tail
of a GPU-frontier node, a load takes the top of a host-resident path. The copies a move implies are
queued on the `HostTier`; nothing is copied here.

Host copies (``copies``): a GPU-resident node may keep a host copy of its blocks, so that its later
eviction is a change of tier with no copy across the bus. A node loaded back from the host keeps the
host blocks it was loaded from as its copy: chat histories and agent traces come back turn after
turn, and writing the same KV out again at each eviction was most of the bus traffic (llama-3.1-8b,
128 conversations of 8 turns over a pool a sixth of their histories: 2.5 M tokens written back for
0.6 M distinct ones). With write-through (``write_through_hits`` k, off when None), a GPU-resident
node matched by more than k admissions gets a copy too, when the host pool has the blocks free. A
copy mirrors the node's blocks one for one: a split divides it as it divides the blocks, an
eviction that drops the node (rather than writing it back) drops it, and the host tier's eviction
takes copies before host-resident nodes (their data is still on the GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from radixinfer.cache.host_tier import HostTier
from radixinfer.cache.tree_node import MatchResult, Node, path_blocks

if TYPE_CHECKING:
    from radixinfer.cache.radix_tree import RadixTree


class HostResidency:
    """The tier moves of ``tree``'s nodes, over the GPU pool and ``host``'s pool, and the
    write-through policy's state beside the tree: admissions per GPU-resident node (``hits``, while
    write-through is on) and host copies (``copies``: node -> host blocks, one per GPU block)."""

    def __init__(self, tree: RadixTree, host: HostTier, write_through_hits: int | None) -> None:
        hits = write_through_hits
        if hits is not None and (not isinstance(hits, int) or isinstance(hits, bool) or hits < 0):
            raise ValueError(f"host_write_through_hits must be an int >= 0 or None, got {hits!r}")
        self.tree = tree
        self.host = host
        self.write_through_hits = write_through_hits
        self.hits: dict[Node, int] = {}
        self.copies: dict[Node, list[int]] = {}

    def _retier(self, node: Node, blocks: list[int], host: bool) -> None:
        """Move ``node`` to the other tier, holding ``blocks`` there (their references are taken;
        the caller drops those of the old ones). Its parent's LRU membership changes with it."""
        tree = self.tree
        tree.version += 1
        moved = tree.lru.leave((node.parent, node))
        node.blocks, node.host = blocks, host
        tree.lru.enter(moved)

    def load(self, node: Node, gpu_blocks: list[int]) -> None:
        """Make the host-resident ``node`` (whose parent is GPU-resident) GPU-resident in
        ``gpu_blocks`` (fresh: one reference each, as many as it lists). The host-to-GPU copies are
        queued on the host tier; the node's host blocks stay as its copy (they hold its KV: a later
        eviction moves nothing, and the host tier's eviction takes them first)."""
        assert node.host and not node.parent.host, f"load of {node}, not the top of a host path"
        pool = self.tree.pool
        bs, fill = pool.block_size, pool.fill
        for index, block in enumerate(gpu_blocks, start=node.start // bs):
            fill[block] = min(bs, node.end - index * bs)  # its positions arrive with the copy
        host_blocks = node.blocks
        self.host.queue(False, host_blocks, gpu_blocks)
        self._retier(node, gpu_blocks, host=False)
        self.copies[node] = host_blocks
        counters = self.host.counters
        counters.loaded_blocks += len(gpu_blocks)
        counters.loaded_tokens += node.end - node.start

    def load_match(
        self, match: MatchResult, query_len: int, make_room: Callable[[int, int], bool]
    ) -> MatchResult:
        """Load the host-resident part of ``match`` (of a query of ``query_len`` tokens) into GPU
        blocks, node by node from the top, while ``make_room(n, end)`` can make ``n`` GPU blocks
        free beside those the caller takes next when the match ends at position ``end``. The path
        is locked meanwhile, so making room evicts neither it nor the host nodes still to load.
        Returns the match as far as it is GPU-resident now, with the host-resident rest (if
        loading stopped short) as its host part.

        Room for the whole part is asked for first, so its write-backs are queued before all of
        its loads (the copies then form one batch of each direction, `HostTier.take_transfers`);
        only when that fails is room made node by node. Making room never takes blocks back, so
        once a node is loaded the caller's blocks for the match ending there stay to be had."""
        tree = self.tree
        end = tree.split_at(match.host_node, match.host_length)
        tree.lock(end)
        chain, node = [], end
        while node.host:
            chain.append(node)
            node = node.parent
        loaded = None
        whole = make_room(sum(len(node.blocks) for node in chain), end.end)
        for node in reversed(chain):
            count = len(node.blocks)
            if not whole and not make_room(count, node.end):
                break  # the rest is computed again
            self.load(node, tree.pool.allocate(count))
            loaded = node
        tree.unlock(end)
        rest = (end, end.end) if end.host else (None, 0)
        if loaded is None:
            return MatchResult(match.length, match.blocks, match.node, None, *rest)
        length = loaded.end
        payload = loaded.payload if length == query_len else None
        return MatchResult(length, path_blocks(loaded, tree.block_size), loaded, payload, *rest)

    def promote(self, host_node: Node, pos: int, blocks: Sequence[int]) -> Node:
        """Make the host-resident path down to position ``pos`` of ``host_node`` GPU-resident in the
        caller's ``blocks`` (a table that stores those positions): nothing is copied. Returns the
        node ending at ``pos``."""
        tree = self.tree
        end = tree.split_at(host_node, pos)
        chain, node = [], end
        while node.host:
            chain.append(node)
            node = node.parent
        bs = tree.block_size
        for node in reversed(chain):
            gpu_blocks = list(blocks[node.start // bs : -(-node.end // bs)])
            tree.pool.incref(gpu_blocks)
            host_blocks = node.blocks
            self._retier(node, gpu_blocks, host=False)
            self.host.pool.decref(host_blocks)
        return end

    def offload_tail(self, node: Node, num_blocks: int, unwritten: dict[int, int]) -> int | None:
        """Write up to ``num_blocks`` blocks of the GPU-frontier ``node``'s tail back to host blocks
        (making host room by the host tier's own eviction): the tail is split off at a block
        boundary and becomes a host-resident node. Returns the GPU blocks freed, or None when
        nothing could be written back (no host block to be had, or a block whose K/V the forward
        being planned has yet to write, listed in ``unwritten``: block -> slots written)."""
        tree, host_pool = self.tree, self.host.pool
        bs = tree.block_size
        count = min(num_blocks, len(node.blocks))
        if node in self.copies:
            return self._evict_to_copy(node, count)
        if host_pool.num_free < count:
            self.evict(count - host_pool.num_free)
        count = min(count, host_pool.num_free)
        if count == 0:
            return None
        first_index = (node.end - 1) // bs - count + 1
        for index, block in enumerate(node.blocks[-count:], start=first_index):
            if unwritten.get(block, bs) < min(bs, node.end - index * bs):
                return None
        if first_index * bs > node.start:
            tree.split_at(node, first_index * bs)  # ``node`` stays the lower half: the tail
        gpu_blocks = node.blocks
        host_blocks = host_pool.allocate(len(gpu_blocks))
        self.host.queue(True, gpu_blocks, host_blocks)
        self._retier(node, host_blocks, host=True)
        self.hits.pop(node, None)
        counters = self.host.counters
        counters.offloaded_blocks += len(gpu_blocks)
        counters.offloaded_tokens += node.end - node.start
        return tree.pool.decref(gpu_blocks)

    def _evict_to_copy(self, node: Node, count: int) -> int:
        """`offload_tail` of a node with a host copy: its last ``count`` blocks' positions become a
        host-resident node holding the copy's blocks; nothing is copied."""
        tree = self.tree
        bs = tree.block_size
        first_index = (node.end - 1) // bs - count + 1
        if first_index * bs > node.start:
            tree.split_at(node, first_index * bs)  # the copy splits with it
        gpu_blocks = node.blocks
        self._retier(node, self.copies.pop(node), host=True)
        self.hits.pop(node, None)
        self.host.counters.evicted_to_copy_tokens += node.end - node.start
        return tree.pool.decref(gpu_blocks)

    def count_hit(self, node: Node, unwritten: dict[int, int]) -> None:
        """An admission matched the GPU-resident path down to ``node``: count a hit on each node of
        it, and copy to the host those hit more than ``write_through_hits`` times that have no copy
        yet, as far as free host blocks go. A node with a block the forward being planned has yet
        to write (``unwritten``: block -> slots written) waits for a later hit."""
        limit, hits, copies = self.write_through_hits, self.hits, self.copies
        host_pool = self.host.pool
        bs = self.tree.block_size
        while node.parent is not None:
            count = hits[node] = hits.get(node, 0) + 1
            if count > limit and node not in copies and len(node.blocks) <= host_pool.num_free:
                first = node.start // bs
                written = all(
                    unwritten.get(block, bs) >= min(bs, node.end - index * bs)
                    for index, block in enumerate(node.blocks, start=first)
                )
                if written:
                    copy = host_pool.allocate(len(node.blocks))
                    self.host.queue(True, node.blocks, copy)
                    copies[node] = copy
                    self.host.counters.written_through_blocks += len(copy)
                    self.host.counters.written_through_tokens += node.end - node.start
            node = node.parent

    def split(self, lower: Node, upper: Node, num_upper: int, lower_dropped: int) -> None:
        """`RadixTree.split_at` made ``upper`` (``num_upper`` blocks) above ``lower``, which dropped
        its first ``lower_dropped`` blocks: divide ``lower``'s copy and hits the same way."""
        if lower in self.hits:
            self.hits[upper] = self.hits[lower]
        copy = self.copies.get(lower)
        if copy is not None:
            self.copies[upper] = copy[:num_upper]
            self.host.pool.incref(copy[:num_upper])
            self.host.pool.decref(copy[:lower_dropped])  # never frees: the upper copy holds them
            self.copies[lower] = copy[lower_dropped:]

    def forget(self, node: Node) -> None:
        """``node`` is being dropped from the GPU (trimmed, not written back): drop its copy and
        hits."""
        self.hits.pop(node, None)
        copy = self.copies.pop(node, None)
        if copy is not None:
            self.host.counters.host_evicted_blocks += self.host.pool.decref(copy)

    def reset(self) -> None:
        """Drop every copy and hit count (the tree is dropping every node)."""
        for copy in self.copies.values():
            self.host.pool.decref(copy)
        self.copies.clear()
        self.hits.clear()

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` host blocks: first write-through copies (oldest first: their
        data is still on the GPU), then by trimming unlocked host-resident leaves from their tails,
        least recently used first, as `RadixTree.evict` does on the GPU. Returns the host blocks
        freed."""
        freed = 0
        copies = self.copies
        while freed < num_blocks and copies:
            node = next(iter(copies))
            freed += self.host.pool.decref(copies.pop(node))
        lru = self.tree.lru
        while freed < num_blocks and lru.host:
            self.tree.version += 1
            freed += lru.trim_tail(lru.host[0], self.host.pool, num_blocks - freed)
        self.host.counters.host_evicted_blocks += freed
        return freed

    def drop_descendants(self, node: Node) -> None:
        """Remove every descendant of the unlocked GPU-frontier ``node`` (all host-resident)."""
        self.tree.version += 1
        stack = list(node.children.values())
        node.children.clear()
        freed = 0
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            self.tree.lru.host.discard(child)
            freed += self.host.pool.decref(child.blocks)
            child.parent, child.payload = None, None
        self.host.counters.host_evicted_blocks += freed
