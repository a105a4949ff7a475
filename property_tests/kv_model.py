"""The test side's independent model of the prefix cache, shared by the state machines.

* **KV content.** A fake KV store maps ``slot -> value``. The value written at position ``p`` of a request is
  ``kv_value(salt, tokens[:p + 1])``: the prefix itself (docs/invariants.md, invariant 3: KV at ``p`` is a function of
  tokens ``[0..p]``), tagged with the request's cache salt. Real KV would not differ between tenants; the tag
  makes any cross-salt sharing visible as a wrong read (invariant 8).
* **Readers.** Who can read a slot right now: every tree node reads its whole path through
  ``tree.path_blocks(node)``, every live sequence its positions ``[0, num_kv)`` through its table. A write may
  only land on a slot nobody reads (invariant 2).
* **Cached paths.** Plain Python sets of token tuples per salt; the longest match is computed here, never by
  asking the tree.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Sequence

from radixinfer.cache.kv_manager import KVCacheManager, SeqKV

Holder = tuple[str, int]  # ("node", node.id) or ("seq", request id)


def kv_value(salt: Hashable, prefix: Sequence[int]) -> tuple:
    return (salt, tuple(prefix))


def slot_of(table: Sequence[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def longest_match(query: Sequence[int], paths: Iterable[Sequence[int]]) -> int:
    """Token-granular longest common prefix of ``query`` with any of ``paths``."""
    return max((lcp(query, p) for p in paths), default=0)


def add_path(paths: set[tuple[int, ...]], path: tuple[int, ...]) -> None:
    """Add ``path`` to a set kept free of paths that are prefixes of others (same prefix closure)."""
    if any(p[: len(path)] == path for p in paths):
        return
    paths.difference_update([p for p in paths if path[: len(p)] == p])
    paths.add(path)


class FakeKV:
    """``slot -> value``; block copies copy every slot of the block, as the batched copy kernel does."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.store: dict[int, tuple] = {}

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """One batched launch: every source is read before any destination is written."""
        bs = self.block_size
        data = [[self.store.get(src * bs + o) for o in range(bs)] for src, _ in copies]
        for (_, dst), values in zip(copies, data):
            for o, value in enumerate(values):
                self.store[dst * bs + o] = value

    def read(self, table: Sequence[int], num_positions: int) -> list:
        return [self.store.get(slot_of(table, p, self.block_size)) for p in range(num_positions)]


def tree_paths(mgr: KVCacheManager) -> dict[Hashable, set[tuple[int, ...]]]:
    """Salt -> token paths of every tree node."""
    paths: dict[Hashable, set[tuple[int, ...]]] = defaultdict(set)
    for salt, node in mgr.tree.nodes():
        paths[salt].add(tuple(mgr.tree.path_tokens(node).tolist()))
    return paths


def readers(mgr: KVCacheManager, seqs: dict[int, tuple[SeqKV, int]]) -> dict[int, set[Holder]]:
    """Slot -> holders that can read it. ``seqs`` maps request id -> (seq, number of positions it reads)."""
    bs, tree = mgr.block_size, mgr.tree
    out: dict[int, set[Holder]] = defaultdict(set)
    for _, node in tree.nodes():
        blocks = tree.path_blocks(node)
        for p in range(node.end):
            out[slot_of(blocks, p, bs)].add(("node", node.id))
    for rid, (seq, num_read) in seqs.items():
        for p in range(num_read):
            out[slot_of(seq.table, p, bs)].add(("seq", rid))
    return out


def check_tree_reads_back(mgr: KVCacheManager, kv: FakeKV) -> None:
    """Invariant 4, tree side: every node reading its path's blocks sees exactly its path's KV."""
    tree = mgr.tree
    for salt, node in tree.nodes():
        path = tree.path_tokens(node).tolist()
        assert len(path) == node.end
        got = kv.read(tree.path_blocks(node), node.end)
        want = [kv_value(salt, path[: p + 1]) for p in range(node.end)]
        assert got == want, f"{node} (salt {salt!r}) reads {got}, its path is {path}"


def check_holders(mgr: KVCacheManager, live: dict[int, tuple[Hashable, SeqKV]]) -> None:
    """Invariants 1 and 8, counted literally: refcount = holders, free = unheld, salts hold disjoint blocks.
    ``live`` maps request id -> (salt, seq)."""
    held: Counter[int] = Counter()
    by_salt: dict[Hashable, set[int]] = defaultdict(set)
    for salt, node in mgr.tree.nodes():
        held.update(node.blocks)
        by_salt[salt].update(node.blocks)
    for salt, seq in live.values():
        held.update(seq.table)
        by_salt[salt].update(seq.table)
    pool = mgr.pool
    for b in range(pool.num_blocks):
        assert pool.refcount[b] == held[b], (
            f"block {b}: refcount {pool.refcount[b]}, {held[b]} holders"
        )
    assert mgr.num_free_blocks == pool.num_blocks - len(held)
    salts = list(by_salt)
    for i, a in enumerate(salts):
        for b in salts[i + 1 :]:
            shared = by_salt[a] & by_salt[b]
            assert not shared, f"salts {a!r} and {b!r} share blocks {shared}"


def counters(mgr: KVCacheManager) -> tuple[int, ...]:
    c = mgr.tree.counters
    return (c.evicted_blocks, mgr.counters.cow_copies)


def check_monotonic(before: tuple[int, ...], after: tuple[int, ...]) -> None:
    assert all(a >= b for a, b in zip(after, before)), f"a counter decreased: {before} -> {after}"
