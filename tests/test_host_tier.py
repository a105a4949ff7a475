"""The host tier at the cache level, on examples: write-back on eviction, load on a match, the
fallback to recompute when no GPU block can be had, and a recomputed path taking the host-resident
one's place (the property machines cover random interleavings)."""

from __future__ import annotations

from radixinfer.cache.kv_manager import KVCacheManager

A = list(range(1, 9))  # 8 tokens: 4 blocks of 2


def _publish(mgr: KVCacheManager, tokens: list[int]) -> None:
    """Admit, compute and publish ``tokens``, then release them (a finished request)."""
    seq = mgr.admit(tokens)
    assert mgr.reserve([seq], [len(tokens)]) is not None
    mgr.mark_written()
    mgr.release(seq, publish=tokens)


def _moved(mgr: KVCacheManager) -> list[tuple[str, int]]:
    return [("offload" if b.offload else "load", len(b.src)) for b in mgr.take_transfers()]


def test_eviction_writes_the_tail_back_and_a_match_loads_it():
    mgr = KVCacheManager(num_blocks=4, block_size=2, host_blocks=8)
    _publish(mgr, A)
    assert _moved(mgr) == []
    _publish(mgr, [50, 51, 52, 53])  # needs 2 blocks: A's last two go to the host
    assert _moved(mgr) == [("offload", 2)]
    assert mgr.cached_prefix_len(A) == 8  # still in the tree, host-resident from position 4
    seq = mgr.admit(A)
    assert (seq.num_cached, seq.num_loaded) == (8, 4)
    assert _moved(mgr) == [("offload", 2), ("load", 2)]  # room made for the load, then the load
    counters = mgr.host.counters
    assert (counters.offloaded_tokens, counters.loaded_tokens) == (8, 4)
    mgr.release(seq)
    mgr.check_integrity([])


def test_a_load_that_cannot_get_blocks_leaves_the_rest_to_compute():
    mgr = KVCacheManager(num_blocks=6, block_size=2, host_blocks=8)
    _publish(mgr, A)
    assert mgr.tree.evict(4) == 4  # all of A goes to the host
    holder = mgr.admit(list(range(20, 28)))
    assert mgr.reserve([holder], [8]) is not None  # a live request holds 4 of the 6 blocks
    seq = mgr.admit(A)
    assert (seq.num_cached, seq.num_loaded) == (0, 0)  # A needs 4 blocks, 2 can be had
    assert mgr.cached_prefix_len(A) == 8  # nothing was lost
    mgr.check_integrity([holder, seq])
    mgr.release(seq)
    mgr.release(holder)
    seq = mgr.admit(A)
    assert (seq.num_cached, seq.num_loaded) == (8, 8)
    mgr.release(seq)
    mgr.check_integrity([])


def test_a_recomputed_prefix_takes_the_host_resident_nodes_place():
    mgr = KVCacheManager(num_blocks=6, block_size=2, host_blocks=8)
    _publish(mgr, A)
    mgr.tree.evict(4)
    mgr.take_transfers()
    holder = mgr.admit(list(range(20, 28)))
    mgr.reserve([holder], [8])
    seq = mgr.admit(A)  # nothing loaded: it computes its first 4 tokens itself
    assert mgr.reserve([seq], [4]) is not None
    mgr.mark_written()
    host_free = mgr.host.pool.num_free
    mgr.publish(seq, A[:4])
    assert mgr.host.pool.num_free == host_free + 2  # its blocks replaced the host copies
    assert _moved(mgr) == []  # nothing copied
    assert mgr.cached_prefix_len(A) == 8
    mgr.check_integrity([holder, seq])
    mgr.release(seq)
    mgr.release(holder)
    mgr.reset()
    assert mgr.host.pool.num_free == 8 and mgr.num_free_blocks == 6
