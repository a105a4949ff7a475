"""The test side's independent model of the prefix cache, shared by the state machines.

* **KV content.** A fake KV store maps ``slot -> value``. The value written at position ``p`` of a request is
  ``kv_value(salt, tokens[:p + 1])``: the prefix itself (docs/invariants.md, invariant 3: KV at ``p`` is a function of
  tokens ``[0..p]``), tagged with the request's cache salt. Real KV would not differ between tenants; the tag
  makes any cross-salt sharing visible as a wrong read (invariant 8).
* **Readers.** Who can read a slot right now: every tree node reads its whole path through
  ``path_blocks(node, block_size)``, every live sequence its positions ``[0, num_kv)`` through its table. A write may
  only land on a slot nobody reads (invariant 2).
* **Cached paths.** Plain Python sets of token tuples per salt; the longest match is computed here, never by
  asking the tree.
* **Host tier.** A second fake store, ``host``, for the host pool's slots. The cache's queued
  transfers (`KVCacheManager.take_transfers`) are applied to the two stores in order, whole blocks
  at a time, as the engine's copy engine does; a host-resident node reads its own positions from its
  host blocks.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Sequence

from radixinfer.cache.kv_manager import KVCacheManager, SeqKV, TransferBatch
from radixinfer.cache.tree_node import path_blocks, path_tokens

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
    """``slot -> value`` for the GPU pool (``store``) and the host pool (``host``); block copies
    copy every slot of the block, as the batched copy kernel and the copy engine do."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.store: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}

    def copy_blocks(
        self,
        copies: Sequence[tuple[int, int]],
        src_store: dict | None = None,
        dst_store: dict | None = None,
    ) -> None:
        """One batched launch: every source is read before any destination is written."""
        bs = self.block_size
        src_store = self.store if src_store is None else src_store
        dst_store = self.store if dst_store is None else dst_store
        data = [[src_store.get(src * bs + o) for o in range(bs)] for src, _ in copies]
        for (_, dst), values in zip(copies, data):
            for o, value in enumerate(values):
                dst_store[dst * bs + o] = value

    def apply_transfers(self, batches: Sequence[TransferBatch]) -> None:
        """Run the host tier's transfer batches in order (offloads GPU to host, loads back)."""
        for batch in batches:
            assert len(set(batch.dst)) == len(batch.dst), f"two copies into one block: {batch}"
            src, dst = (self.store, self.host) if batch.offload else (self.host, self.store)
            self.copy_blocks(list(zip(batch.src, batch.dst)), src, dst)

    def read(self, table: Sequence[int], num_positions: int) -> list:
        return [self.store.get(slot_of(table, p, self.block_size)) for p in range(num_positions)]


def tree_paths(mgr: KVCacheManager, gpu_only: bool = False) -> dict[Hashable, set[tuple[int, ...]]]:
    """Salt -> token paths of every tree node (``gpu_only``: of every GPU-resident one)."""
    paths: dict[Hashable, set[tuple[int, ...]]] = defaultdict(set)
    for salt, node in mgr.tree.nodes():
        if not (gpu_only and node.host):
            paths[salt].add(tuple(path_tokens(node).tolist()))
    return paths


def readers(mgr: KVCacheManager, seqs: dict[int, tuple[SeqKV, int]]) -> dict[int, set[Holder]]:
    """Slot -> holders that can read it. ``seqs`` maps request id -> (seq, number of positions it reads)."""
    bs, tree = mgr.block_size, mgr.tree
    out: dict[int, set[Holder]] = defaultdict(set)
    for _, node in tree.nodes():
        if node.host:  # it reads host slots only
            continue
        blocks = path_blocks(node, bs)
        for p in range(node.end):
            out[slot_of(blocks, p, bs)].add(("node", node.id))
    for rid, (seq, num_read) in seqs.items():
        for p in range(num_read):
            out[slot_of(seq.table, p, bs)].add(("seq", rid))
    return out


def check_tree_reads_back(mgr: KVCacheManager, kv: FakeKV) -> None:
    """Invariant 4, tree side: every GPU-resident node reading its path's blocks sees exactly its
    path's KV, and every host-resident node's host blocks hold exactly the KV of its own positions
    (so whatever round trips a block made between the tiers, it came back with its own path's
    KV)."""
    tree, bs = mgr.tree, mgr.block_size
    salt_of = {}
    for salt, node in tree.nodes():
        salt_of[node] = salt
        path = path_tokens(node).tolist()
        assert len(path) == node.end
        if node.host:
            shift = node.start // bs * bs  # a node's blocks start at its first position's block
            own = range(node.start, node.end)
            got = [kv.host.get(slot_of(node.blocks, p - shift, bs)) for p in own]
            want = [kv_value(salt, path[: p + 1]) for p in own]
        else:
            got = kv.read(path_blocks(node, bs), node.end)
            want = [kv_value(salt, path[: p + 1]) for p in range(node.end)]
        assert got == want, f"{node} (salt {salt!r}) reads {got}, its path is {path}"
    copies = mgr.tree.tiers.copies if mgr.tree.tiers is not None else {}
    for node, copy in copies.items():  # a write-through copy holds the node's own positions' KV
        path = path_tokens(node).tolist()
        shift = node.start // bs * bs
        got = [kv.host.get(slot_of(copy, p - shift, bs)) for p in range(node.start, node.end)]
        want = [kv_value(salt_of[node], path[: p + 1]) for p in range(node.start, node.end)]
        assert got == want, f"{node}'s host copy holds {got}, its path is {path}"


def check_holders(mgr: KVCacheManager, live: dict[int, tuple[Hashable, SeqKV]]) -> None:
    """Invariants 1 and 8, counted literally: refcount = holders, free = unheld, salts hold disjoint blocks
    (in both pools; a node's write-through copy holds host blocks). ``live`` maps request id -> (salt,
    seq)."""
    held: Counter[int] = Counter()
    host_held: Counter[int] = Counter()
    by_salt: dict[Hashable, set[int]] = defaultdict(set)
    host_by_salt: dict[Hashable, set[int]] = defaultdict(set)
    copies = mgr.tree.tiers.copies if mgr.tree.tiers is not None else {}
    for salt, node in mgr.tree.nodes():
        (host_held if node.host else held).update(node.blocks)
        (host_by_salt if node.host else by_salt)[salt].update(node.blocks)
        if node in copies:  # a write-through copy holds host blocks too
            host_held.update(copies[node])
            host_by_salt[salt].update(copies[node])
    if mgr.host is not None:  # both pools: refcount = holders, free = unheld
        host_pool = mgr.host.pool
        for b in range(host_pool.num_blocks):
            assert host_pool.refcount[b] == host_held[b], (
                f"host block {b}: refcount {host_pool.refcount[b]}, {host_held[b]} holders"
            )
        assert host_pool.num_free == host_pool.num_blocks - len(host_held)
        _check_disjoint(host_by_salt)
    for salt, seq in live.values():
        held.update(seq.table)
        by_salt[salt].update(seq.table)
    pool = mgr.pool
    for b in range(pool.num_blocks):
        assert pool.refcount[b] == held[b], (
            f"block {b}: refcount {pool.refcount[b]}, {held[b]} holders"
        )
    assert mgr.num_free_blocks == pool.num_blocks - len(held)
    _check_disjoint(by_salt)


def _check_disjoint(by_salt: dict[Hashable, set[int]]) -> None:
    salts = list(by_salt)
    for i, a in enumerate(salts):
        for b in salts[i + 1 :]:
            shared = by_salt[a] & by_salt[b]
            assert not shared, f"salts {a!r} and {b!r} share blocks {shared}"


def counters(mgr: KVCacheManager) -> tuple[int, ...]:
    c = mgr.tree.counters
    host = list(vars(mgr.host.counters).values()) if mgr.host is not None else []
    return (c.evicted_blocks, mgr.counters.cow_copies, *host)


def check_monotonic(before: tuple[int, ...], after: tuple[int, ...]) -> None:
    assert all(a >= b for a, b in zip(after, before)), f"a counter decreased: {before} -> {after}"
