"""The host tier at the cache level, on examples: write-back on eviction, load on a match, the
fallback to recompute when no GPU block can be had, and a recomputed path taking the host-resident
one's place (the property machines cover random interleavings)."""

from __future__ import annotations

import pytest

from radixinfer.cache.host_tier import HostTier
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


def test_write_through_copies_a_prefix_hit_more_than_k_times_and_its_eviction_moves_nothing():
    mgr = KVCacheManager(num_blocks=6, block_size=2, host_blocks=8, host_write_through_hits=1)
    _publish(mgr, A)
    mgr.release(mgr.admit(A))  # one hit: not more than 1
    assert _moved(mgr) == [] and mgr.host.counters.written_through_tokens == 0
    mgr.release(mgr.admit(A))  # the second
    assert _moved(mgr) == [("offload", 4)]  # copied while it stays on the GPU
    counters = mgr.host.counters
    assert (counters.written_through_blocks, counters.written_through_tokens) == (4, 8)
    mgr.release(mgr.admit(A))  # a third hit copies nothing more
    assert _moved(mgr) == []
    mgr.check_integrity([])
    _evict_onto_the_copy_and_load_back(mgr)
    assert (counters.evicted_to_copy_tokens, counters.offloaded_tokens) == (8, 0)


def _evict_onto_the_copy_and_load_back(mgr: KVCacheManager) -> None:
    """A (4 blocks, GPU-resident with a host copy) is evicted, which moves nothing (the eviction
    takes the copy), then admitted again, which loads it back whole."""
    assert mgr.tree.evict(4) == 4
    assert _moved(mgr) == []
    seq = mgr.admit(A)
    assert (seq.num_cached, seq.num_loaded) == (8, 8)
    assert _moved(mgr) == [("load", 4)]
    mgr.release(seq)
    mgr.check_integrity([])


def _copied(num_blocks: int, host_blocks: int) -> KVCacheManager:
    """A cache with write-through after 0 hits, where A was published and hit once: copied."""
    mgr = KVCacheManager(num_blocks, 2, host_blocks=host_blocks, host_write_through_hits=0)
    _publish(mgr, A)
    mgr.release(mgr.admit(A))
    assert _moved(mgr) == [("offload", 4)]
    return mgr


def test_a_split_divides_the_copy_and_a_partial_eviction_takes_its_tail():
    mgr = _copied(num_blocks=8, host_blocks=8)
    seq = mgr.admit(A[:5])  # ends mid-node: the node and its copy split at position 5
    assert seq.num_cached == 5
    mgr.check_integrity([seq])
    mgr.release(seq)
    assert mgr.tree.evict(1) == 1  # the tail block goes onto its copy
    assert _moved(mgr) == []
    assert mgr.host.counters.evicted_to_copy_tokens == 2
    assert mgr.cached_prefix_len(A) == 8
    mgr.check_integrity([])
    mgr.reset()
    assert mgr.host.pool.num_free == 8 and mgr.num_free_blocks == 8


def test_write_through_waits_for_blocks_the_forward_has_yet_to_write():
    mgr = KVCacheManager(num_blocks=8, block_size=2, host_blocks=8, host_write_through_hits=0)
    writer = mgr.admit(A)
    assert mgr.reserve([writer], [8]) is not None
    mgr.publish(writer, A, prompt_end=True)  # published before the forward that writes it
    reader = mgr.admit(A)  # a hit on unwritten blocks: no copy yet
    assert reader.num_cached == 8 and _moved(mgr) == []
    mgr.mark_written()
    mgr.release(mgr.admit(A))  # the next hit copies it
    assert _moved(mgr) == [("offload", 4)]
    mgr.release(reader)
    mgr.release(writer)
    mgr.check_integrity([])


def test_the_host_tier_gives_up_copies_before_host_resident_prefixes():
    mgr = _copied(num_blocks=6, host_blocks=4)  # the host pool is all A's copy
    _publish(mgr, [50, 51, 52, 53])
    mgr.release(mgr.admit(A))  # A is used more recently than the new prefix
    _publish(mgr, [60, 61, 62, 63])  # evicts [50..53], which has no copy: it is written back
    assert _moved(mgr) == [("offload", 2)]
    assert mgr.host.counters.host_evicted_blocks == 4  # room made by dropping A's copy
    assert mgr.cached_prefix_len(A) == 8 and mgr.cached_prefix_len([50, 51, 52, 53]) == 4
    mgr.check_integrity([])


def test_loaded_blocks_are_loading_until_their_ticket_finishes():
    mgr = KVCacheManager(num_blocks=8, block_size=2, host_blocks=8)
    _publish(mgr, A)
    mgr.tree.evict(4)
    seq = mgr.admit(A)
    assert seq.num_loaded == 8 and mgr.is_loading(seq)
    mgr.take_transfers()
    ticket = mgr.host.tickets_taken
    mgr.host.finish_loads(ticket - 1)  # an earlier take's loads finishing frees nothing here
    assert mgr.is_loading(seq)
    twin = mgr.admit(A)  # a hit on the loaded blocks reads them too
    assert twin.num_loaded == 0 and mgr.is_loading(twin)
    mgr.host.finish_loads(ticket)
    assert not mgr.is_loading(seq) and not mgr.is_loading(twin)
    for s in (seq, twin):
        mgr.release(s)
    mgr.check_integrity([])


def test_write_backs_alone_are_one_batch_in_which_a_later_copy_into_a_block_wins():
    """Copies queued by two evictions, the second writing a host block the first wrote too (freed
    by the host tier's eviction and handed out again): one batch, the later copy kept, and the
    queue took copies of the callers' lists."""
    host = HostTier(num_blocks=8, block_size=2)
    first_src, first_dst = [4, 5], [0, 1]
    host.queue(True, first_src, first_dst)
    host.queue(True, [6], [1])
    first_src[0] = 7  # the caller's list changes after the queue took it
    (batch,) = host.take_transfers()
    assert batch.offload and not batch.reads_loading
    assert dict(zip(batch.dst, batch.src)) == {0: 4, 1: 6}
    assert host.take_transfers() == []


def test_publishing_does_not_remap_onto_blocks_still_loading():
    mgr = KVCacheManager(num_blocks=12, block_size=2, host_blocks=8)
    computer = mgr.admit(A)  # computes A itself
    assert mgr.reserve([computer], [8]) is not None
    mgr.mark_written()
    _publish(mgr, A)  # publishes A from other blocks: the tree holds those
    mgr.tree.evict(4)  # ... and writes them back
    loader = mgr.admit(A)  # loads A into fresh blocks, still loading
    assert loader.num_loaded == 8
    mgr.publish(computer, A)  # the tree's blocks are loading: the computer keeps its own
    assert not mgr.is_loading(computer)
    mgr.check_integrity([computer, loader])
    for s in (computer, loader):
        mgr.release(s)
    mgr.check_integrity([])


def test_bad_write_through_settings_are_value_errors_naming_them():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="host_write_through_hits"):
            KVCacheManager(num_blocks=4, block_size=2, host_blocks=4, host_write_through_hits=bad)
    with pytest.raises(ValueError, match="host_write_through_hits"):
        KVCacheManager(num_blocks=4, block_size=2, host_write_through_hits=1)  # no host tier


def test_a_loaded_prefix_keeps_its_host_blocks_and_its_next_eviction_moves_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=2, host_blocks=8)
    _publish(mgr, A)
    assert mgr.tree.evict(4) == 4  # all of A goes to the host
    assert _moved(mgr) == [("offload", 4)]
    mgr.release(mgr.admit(A))
    assert _moved(mgr) == [("load", 4)]
    counters = mgr.host.counters
    assert mgr.host.pool.num_free == 4  # the host blocks A came from are still held, as its copy
    mgr.check_integrity([])
    _evict_onto_the_copy_and_load_back(mgr)
    assert (counters.offloaded_tokens, counters.evicted_to_copy_tokens) == (8, 8)
