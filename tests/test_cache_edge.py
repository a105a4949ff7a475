"""Edge cases of the prefix cache core (block pool, radix tree, KV cache manager), through public methods.

The stateful property tests in ``property_tests/`` cover random interleavings; these pin down the corners
and the regressions by name. No test asserts exact block ids.
"""

from __future__ import annotations

import pytest

from radixinfer.cache.block_pool import BlockPool, OutOfBlocks
from radixinfer.cache.kv_manager import KVCacheManager, SeqKV
from radixinfer.cache.tree_node import as_token_array


def run_prompt(mgr: KVCacheManager, tokens: list[int], salt=None, *, publish: bool = True) -> SeqKV:
    """Admit ``tokens``, reserve what was not cached, run the forward (`mark_written`), publish the prompt."""
    seq = mgr.admit(tokens, salt)
    assert mgr.reserve([seq], [len(tokens)]) is not None
    mgr.mark_written()
    if publish:
        mgr.publish(seq, tokens, prompt_end=True)
    return seq


def finish(mgr: KVCacheManager, seq: SeqKV, tokens: list[int]) -> None:
    mgr.publish(seq, tokens[: seq.num_kv])
    mgr.release(seq)


def cached_len(mgr: KVCacheManager, tokens: list[int], salt=None) -> int:
    """Length of the cached prefix (a match changes nothing, not even the LRU order)."""
    return mgr.tree.match(as_token_array(tokens), salt).length


def repeat_payload(mgr: KVCacheManager, tokens: list[int]):
    """The payload an admission of ``tokens`` gets (the admission is released again)."""
    seq = mgr.admit(tokens)
    mgr.release(seq)
    return seq.payload


def num_nodes(mgr: KVCacheManager) -> int:
    return len(mgr.tree.nodes())


# ---------------------------------------------------------------------------------------------- empty tree
def test_empty_tree_matches_nothing_and_evicts_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    seq = mgr.admit([1, 2, 3])
    assert (seq.num_kv, seq.num_cached, seq.table, seq.payload) == (0, 0, [], None)
    mgr.check_integrity([seq])
    mgr.release(seq)
    assert mgr.tree.evict(10) == 0
    mgr.reset()
    assert mgr.num_free_blocks == 4
    mgr.check_integrity([])


def test_release_is_idempotent():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    seq = run_prompt(mgr, [1, 2, 3])
    mgr.release(seq)
    mgr.release(seq)
    mgr.check_integrity([])
    mgr.reset()
    assert mgr.num_free_blocks == 4


# ------------------------------------------------------------------------------------------ insert / match
def test_duplicate_publish_adds_nothing():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = run_prompt(mgr, [1, 2, 3, 4, 5])
    nodes, free = num_nodes(mgr), mgr.num_free_blocks
    assert mgr.publish(a, [1, 2, 3, 4, 5], prompt_end=True) == 0
    b = mgr.admit([1, 2, 3, 4, 5])
    assert b.num_cached == 5
    assert mgr.publish(b, [1, 2, 3, 4, 5]) == 0
    assert (num_nodes(mgr), mgr.num_free_blocks) == (nodes, free)
    mgr.check_integrity([a, b])


def test_duplicate_computed_blocks_are_remapped_then_freed():
    """Two requests compute the same prompt before either publishes: the second publish points its table
    at the tree's full blocks and frees its own copies (invariant 7)."""
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a = run_prompt(mgr, prompt, publish=False)
    b = run_prompt(mgr, prompt, publish=False)
    assert a.table != b.table
    free = mgr.num_free_blocks
    assert mgr.publish(a, prompt) == 5
    assert mgr.publish(b, prompt) == 0
    assert b.table[:2] == a.table[:2]  # the full blocks now come from the tree
    assert (
        b.table[2] != a.table[2]
    )  # the boundary block is never remapped (b may still write past it)
    assert mgr.num_free_blocks == free + 2
    mgr.check_integrity([a, b])


def test_match_ending_mid_block_shares_the_block_then_copies_it_on_write():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = run_prompt(mgr, [1, 2, 3, 4, 5, 6])
    b = mgr.admit([1, 2, 3, 9, 9])
    assert b.num_cached == 3
    assert (
        b.table == a.table[:1]
    )  # the boundary block is shared, positions 0..2 of it are b's prefix
    plan = mgr.reserve([b], [5])
    assert plan.copies == [(a.table[0], b.table[0])]  # slot 3 was written by a: copy before writing
    assert mgr.counters.cow_copies == 1
    mgr.check_integrity([a, b])


def test_first_writer_claims_an_unwritten_slot_of_a_shared_block():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = run_prompt(mgr, [1, 2, 3])
    finish(mgr, a, [1, 2, 3])  # nobody wrote position 3 of the boundary block
    b = mgr.admit([1, 2, 3, 7])
    c = mgr.admit([1, 2, 3, 8])
    assert b.table == c.table
    plan_b = mgr.reserve([b], [4])
    assert plan_b.copies == []  # b claims slot 3 in place
    plan_c = mgr.reserve([c], [4])
    assert len(plan_c.copies) == 1  # c must not overwrite b's slot 3
    assert plan_b.slots[0] != plan_c.slots[0]
    mgr.check_integrity([b, c])


def test_match_stops_at_the_first_mismatch_even_when_later_tokens_fit_a_child():
    """The walk picks children by first token and checks the keys afterwards: a mismatch inside an edge
    must end the match there, though the next token happens to start a child of that edge."""
    mgr = KVCacheManager(num_blocks=16, block_size=2)
    a = run_prompt(mgr, [1, 2, 3, 9, 9])
    b = run_prompt(mgr, [1, 2, 3, 7])  # the node for [1, 2, 3] now has children "9 9" and "7"
    assert cached_len(mgr, [1, 2, 5, 9, 9]) == 2
    assert cached_len(mgr, [1, 2, 3, 9, 8]) == 4
    seq = mgr.admit([1, 2, 5, 9, 9])
    assert seq.table == a.table[:1]
    mgr.check_integrity([a, b, seq])


def test_block_size_one_never_copies():
    mgr = KVCacheManager(num_blocks=16, block_size=1)
    a = run_prompt(mgr, [1, 2, 3, 4])
    b = mgr.admit([1, 2, 5])
    assert b.num_cached == 2 and b.table == a.table[:2]
    plan = mgr.reserve([b], [3])
    assert plan.copies == []
    mgr.publish(b, [1, 2, 5])
    assert cached_len(mgr, [1, 2, 5]) == 3 and cached_len(mgr, [1, 2, 3, 4]) == 4
    mgr.check_integrity([a, b])


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 8])
def test_split_at_every_offset_of_an_edge(block_size):
    path = [1, 2, 3, 4, 5, 6, 7]
    for k in range(1, len(path)):
        mgr = KVCacheManager(num_blocks=16, block_size=block_size)
        a = run_prompt(mgr, path)
        mgr.attach_payload(a, "a's hidden state")
        other = path[:k] + [9, 9]
        b = run_prompt(mgr, other)
        assert b.num_cached == k
        assert num_nodes(mgr) == 3
        assert cached_len(mgr, path) == len(path) and cached_len(mgr, other) == len(other)
        assert cached_len(mgr, path[:k] + [8]) == k
        repeat = mgr.admit(path)
        assert (
            repeat.payload == "a's hidden state"
        )  # the payload stays with the lower half of the split
        mgr.check_integrity([a, b, repeat])


def test_publish_with_prompt_end_splits_so_a_node_ends_at_the_prompt():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = run_prompt(mgr, [1, 2, 3, 4, 5, 6])
    b = mgr.admit([1, 2, 3])  # an exact repeat of a prefix: ends mid-edge, no payload yet
    assert b.payload is None and b.num_cached == 3
    mgr.publish(b, [1, 2, 3], prompt_end=True)
    mgr.attach_payload(b, "b's hidden state")
    assert repeat_payload(mgr, [1, 2, 3]) == "b's hidden state"
    assert repeat_payload(mgr, [1, 2, 3, 4, 5, 6]) is None  # nobody attached one at a's prompt end
    mgr.check_integrity([a, b])


# ------------------------------------------------------------------------------------------ payload
def test_payload_dropped_with_eviction():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = run_prompt(mgr, [1, 2, 3])
    mgr.attach_payload(a, "hidden")
    mgr.release(a)
    assert mgr.tree.evict(8) == 2
    b = run_prompt(mgr, [1, 2, 3])  # recomputed and published again, without a payload this time
    assert b.num_cached == 0
    assert repeat_payload(mgr, [1, 2, 3]) is None


def test_payload_only_for_an_exact_repeat():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = run_prompt(mgr, [1, 2, 3])
    mgr.attach_payload(a, "hidden")
    assert repeat_payload(mgr, [1, 2, 3]) == "hidden"
    assert repeat_payload(mgr, [1, 2]) is None
    assert repeat_payload(mgr, [1, 2, 3, 4]) is None


# ------------------------------------------------------------------------------------------ salts
def test_salts_never_share():
    mgr = KVCacheManager(num_blocks=16, block_size=2)
    a = run_prompt(mgr, [1, 2, 3, 4], salt="tenant-a")
    assert cached_len(mgr, [1, 2, 3, 4], salt="tenant-a") == 4
    assert cached_len(mgr, [1, 2, 3, 4], salt="tenant-b") == 0
    assert cached_len(mgr, [1, 2, 3, 4]) == 0  # no salt is a salt of its own
    b = run_prompt(mgr, [1, 2, 3, 4], salt="tenant-b")
    assert not set(a.table) & set(b.table)
    mgr.check_integrity([a, b])


# ------------------------------------------------------------------------------------------ memory
def test_pool_allocation_beyond_the_pool_raises_and_allocates_nothing():
    pool = BlockPool(num_blocks=3, block_size=4)
    held = pool.allocate(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity({b: 1 for b in held})


def test_reserve_beyond_the_pool_returns_none_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    a = run_prompt(mgr, [1, 2, 3])  # 2 blocks, locked by a
    b = mgr.admit([1, 2, 7])
    table, free, refcounts = list(b.table), mgr.num_free_blocks, list(mgr.pool.refcount)
    assert mgr.reserve([b], [7]) is None  # needs 3 fresh blocks, 1 free, nothing evictable
    assert (b.table, b.num_kv, mgr.num_free_blocks, list(mgr.pool.refcount)) == (
        table,
        2,
        free,
        refcounts,
    )
    assert mgr.counters.cow_copies == 0
    mgr.check_integrity([a, b])


def test_reserve_evicts_lru_leaves_when_short():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    finish(mgr, run_prompt(mgr, [1, 2, 3, 4]), [1, 2, 3, 4])
    seq = mgr.admit([5, 6, 7, 8, 9])
    assert mgr.reserve([seq], [5]) is not None  # 3 blocks: the tree's unlocked path gives way
    assert mgr.tree.counters.evicted_blocks >= 1
    mgr.check_integrity([seq])


def test_eviction_with_everything_locked_frees_nothing():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    seqs = [run_prompt(mgr, p) for p in ([1, 2, 3], [1, 4, 5], [6, 7])]
    nodes, free = num_nodes(mgr), mgr.num_free_blocks
    assert mgr.tree.evict(8) == 0
    assert (num_nodes(mgr), mgr.num_free_blocks) == (nodes, free)
    assert mgr.tree.counters.evicted_blocks == 0
    mgr.check_integrity(seqs)


def test_eviction_takes_least_recently_used_leaves_first():
    mgr = KVCacheManager(num_blocks=16, block_size=2)
    paths = {"a": [1, 1], "b": [2, 2], "c": [3, 3]}
    for path in paths.values():
        finish(mgr, run_prompt(mgr, path), path)
    mgr.release(mgr.admit(paths["a"]))  # a is now the most recently used
    assert mgr.tree.evict(1) == 1
    assert [cached_len(mgr, p) for p in paths.values()] == [2, 0, 2]  # b went first
    assert mgr.tree.evict(1) == 1
    assert [cached_len(mgr, p) for p in paths.values()] == [2, 0, 0]  # then c
    assert mgr.tree.evict(1) == 1
    assert [cached_len(mgr, p) for p in paths.values()] == [0, 0, 0]


def test_eviction_frees_only_unshared_blocks():
    """A leaf whose block a live sequence still holds is removed, but the block stays held."""
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = run_prompt(mgr, [1, 2, 3, 4, 5])
    mgr.publish(
        a, [1, 2], prompt_end=True
    )  # a's lock moves up; the node for [2, 5) is an unlocked leaf
    free = mgr.num_free_blocks
    mgr.tree.evict(1)
    assert cached_len(mgr, [1, 2, 3, 4, 5]) == 2
    assert mgr.num_free_blocks == free  # a still holds both blocks
    mgr.check_integrity([a])


@pytest.mark.parametrize("need", [1, 2, 3, 4, 5])
def test_evicting_several_blocks_at_once_keeps_what_one_at_a_time_keeps(need):
    """A cached path [0, 10) in blocks of 2, and a live sequence holding the blocks of [0, 6) with
    its lock moved up to [0, 2): the leaf [6, 10) goes first (2 blocks freed), then [2, 6), whose
    blocks are dropped but not freed. Evicting ``need`` blocks in one call keeps and frees what
    ``need`` one-block evictions do."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]

    def build() -> tuple[KVCacheManager, SeqKV]:
        mgr = KVCacheManager(num_blocks=16, block_size=2)
        finish(mgr, run_prompt(mgr, prompt), prompt)
        holder = run_prompt(mgr, prompt[:6])
        mgr.publish(holder, prompt[:2], prompt_end=True)  # its lock moves up to [0, 2)
        return mgr, holder

    (once, held_once), (steps, held_steps) = build(), build()
    freed_once = once.tree.evict(need)
    freed_steps = 0
    for _ in range(need):
        freed_steps += steps.tree.evict(1)
    assert freed_once == freed_steps == min(need, 2)
    kept = {1: 8, 2: 6}.get(need, 2)  # then [2, 6) goes whole: its held blocks free nothing
    assert cached_len(once, prompt) == cached_len(steps, prompt) == kept
    assert once.num_free_blocks == steps.num_free_blocks
    once.check_integrity([held_once])
    steps.check_integrity([held_steps])


def test_all_blocks_free_after_everything_ends_and_reset():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = run_prompt(mgr, [1, 2, 3])
    b = run_prompt(mgr, [1, 2, 4, 5])
    assert mgr.reserve([a, b], [a.num_kv + 1, b.num_kv + 1]) is not None
    finish(mgr, a, [1, 2, 3, 9])
    mgr.release(b)  # abort
    mgr.reset()
    assert mgr.num_free_blocks == 8 and num_nodes(mgr) == 0


# ------------------------------------------------------------------------------------------ counters
def test_counters_are_monotonic_across_reset():
    mgr = KVCacheManager(num_blocks=8, block_size=4)

    def counters() -> tuple[int, int]:
        return (mgr.tree.counters.evicted_blocks, mgr.counters.cow_copies)

    a = run_prompt(mgr, [1, 2, 3, 4, 5, 6])
    b = mgr.admit([1, 2, 3, 9])
    mgr.reserve([b], [4])  # copies the shared boundary block
    mgr.release(a)
    mgr.release(b)
    mgr.tree.evict(1)
    assert counters() == (1, 1)
    mgr.reset()
    assert counters() == (1, 1)  # a reset empties the cache, not the statistics
    run_prompt(mgr, [1, 2])
    assert counters() == (1, 1)


# ------------------------------------------------------------------------------------------ regressions
def test_empty_match_holds_no_lock():
    """Regression: an admission that matched nothing kept the root as its "locked" node, and
    `check_integrity` rejected every such live sequence."""
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    seq = mgr.admit([1, 2, 3])
    assert seq.node is None
    mgr.check_integrity([seq])


def test_batched_reserve_counts_the_copy_a_batch_neighbour_forces():
    """Regression: two sequences on the same unwritten slot of a shared block in one `reserve`. The first
    claims the slot, which forces the second to copy; the memory check counted no copy, so with a full pool
    `reserve` raised OutOfBlocks halfway (after growing the first sequence) instead of returning None."""
    mgr = KVCacheManager(num_blocks=2, block_size=4)
    finish(mgr, run_prompt(mgr, [1, 2]), [1, 2])
    x, y = mgr.admit([1, 2]), mgr.admit([1, 2])
    other = run_prompt(mgr, [5, 5, 5, 5])  # takes the last free block
    assert mgr.reserve([x, y], [3, 3]) is None
    assert (x.num_kv, y.num_kv) == (2, 2)
    mgr.release(other)
    plan = mgr.reserve([x, y], [3, 3])
    assert len(plan.copies) == 1 and len(set(plan.slots)) == 2
    mgr.check_integrity([x, y])


def test_publish_keeps_duplicates_the_current_forward_still_writes():
    """Regression: publishing before `mark_written` remapped a duplicate block whose K/V the pending forward
    was still to write and freed it; the next allocation of the same round got it, so one forward would
    have written two sequences' K/V into the same slots."""
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a, b = mgr.admit(prompt), mgr.admit(prompt)
    mgr.reserve([a], [5])
    mgr.reserve([b], [5])  # same round: b computes the same prompt into its own blocks
    mgr.publish(a, prompt)
    table, free = list(b.table), mgr.num_free_blocks
    mgr.publish(b, prompt)
    assert (b.table, mgr.num_free_blocks) == (table, free)  # b's pending blocks stay b's
    mgr.check_integrity([a, b])
    mgr.mark_written()
    mgr.publish(b, prompt)  # written now: the duplicates go
    assert b.table[:2] == a.table[:2] and mgr.num_free_blocks == free + 2
    mgr.check_integrity([a, b])


def test_copy_of_a_rewritten_stale_slot_waits_for_the_forward():
    """Regression: a sole holder rewriting slots someone else had filled before (fill > its offset) left
    `needs_copy_of_unwritten` believing those slots written, so a sequence of the same round copied the block
    before the forward had written them."""
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    x = run_prompt(mgr, [1, 2, 3, 4, 5, 6])
    y = mgr.admit([1, 2, 3, 4, 5, 6, 9])
    mgr.reserve([y], [7])  # y claims slot 2 of x's boundary block (fill 3)
    mgr.mark_written()
    mgr.release(y)
    mgr.publish(
        x, [1, 2, 3, 4], prompt_end=True
    )  # x's lock moves up: the node for [4, 6) is unlocked
    mgr.tree.evict(
        1
    )  # ... and evicted: x alone holds the boundary block, whose fill (3) is past x's offset
    assert (
        mgr.reserve([x], [8]) is not None
    )  # x rewrites slots 2 and 3 in place; the forward is pending
    mgr.publish(x, [1, 2, 3, 4, 5, 6, 7, 8])
    z = mgr.admit([1, 2, 3, 4, 5, 6, 7, 0])
    assert z.num_cached == 7
    assert mgr.needs_copy_of_unwritten(
        z, 8
    )  # z's copy would read slot 2, which x's forward has not written
    mgr.check_integrity([x, z])


@pytest.fixture
def counted_walks(monkeypatch):
    """Counts `RadixTree._walk` calls (walks from a root) while still walking."""
    from radixinfer.cache.radix_tree import RadixTree

    calls = []
    real = RadixTree._walk
    monkeypatch.setattr(RadixTree, "_walk", lambda self, *a: calls.append(1) or real(self, *a))
    return calls


def test_peek_then_admit_then_publish_walk_the_tree_once(counted_walks):
    mgr = KVCacheManager(num_blocks=64, block_size=4)
    finish(mgr, run_prompt(mgr, list(range(10))), list(range(10)))
    tokens = as_token_array(list(range(8)) + [50, 51, 52])
    counted_walks.clear()
    assert mgr.cached_prefix_len(tokens) == 8
    seq = mgr.admit(tokens)
    assert (seq.num_kv, len(seq.table)) == (8, 2)
    assert mgr.reserve([seq], [len(tokens)]) is not None
    mgr.mark_written()
    mgr.publish(seq, tokens, prompt_end=True)
    assert len(counted_walks) == 1
    assert cached_len(mgr, tokens) == len(tokens) and cached_len(mgr, list(range(10))) == 10
    finish(mgr, seq, tokens.tolist())
    mgr.check_integrity([])


def test_a_tree_change_after_the_peek_makes_admit_and_publish_walk_again(counted_walks):
    mgr = KVCacheManager(num_blocks=64, block_size=4)
    tokens = as_token_array(list(range(12)))
    assert mgr.cached_prefix_len(tokens) == 0
    other = run_prompt(mgr, list(range(9)))  # publishes 9 of the peeked prompt's tokens
    counted_walks.clear()
    seq = mgr.admit(tokens)
    assert seq.num_kv == 9 and len(counted_walks) == 1  # the stale peek was not used
    assert mgr.reserve([seq], [12]) is not None
    finish(mgr, other, list(range(9)))  # changes the tree between admission and publish
    mgr.mark_written()
    counted_walks.clear()
    mgr.publish(seq, tokens, prompt_end=True)
    assert len(counted_walks) == 1
    finish(mgr, seq, tokens.tolist())
    mgr.check_integrity([])
    assert cached_len(mgr, tokens) == 12


def test_publishing_past_a_fully_cached_prompt_walks_again(counted_walks):
    """A prompt the tree holds to its end says nothing about the tokens after it: publishing the prompt plus
    its output must walk on (the tree holds [0, 0, 0]; the reused admission walk of [0] would have hung a
    second child for token 0 under the root's edge, orphaning the cached [0, 0, 0] and its blocks)."""
    mgr = KVCacheManager(num_blocks=4, block_size=1)
    first = mgr.admit([0])
    assert mgr.reserve([first], [3]) is not None
    mgr.mark_written()
    finish(mgr, first, [0, 0, 0])
    seq = mgr.admit([0])
    assert seq.num_kv == 1
    assert mgr.reserve([seq], [2]) is not None
    mgr.mark_written()
    counted_walks.clear()
    assert mgr.publish(seq, [0, 0]) == 0  # nothing new: the tree held [0, 0] already
    assert len(counted_walks) == 1
    mgr.check_integrity([seq])
    finish(mgr, seq, [0, 0])
    assert cached_len(mgr, [0, 0, 0]) == 3
    mgr.check_integrity([])


def test_publishing_past_a_prompt_the_tree_diverged_from_reuses_the_admission_walk(counted_walks):
    mgr = KVCacheManager(num_blocks=64, block_size=4)
    finish(mgr, run_prompt(mgr, list(range(10))), list(range(10)))
    tokens = list(range(6)) + [50, 51]  # the tree diverges at 6, before the prompt's end
    seq = mgr.admit(tokens)
    assert mgr.reserve([seq], [10]) is not None
    mgr.mark_written()
    counted_walks.clear()
    assert mgr.publish(seq, tokens + [52, 53]) == 4  # prompt plus output: the walk still stops at 6
    assert len(counted_walks) == 0
    finish(mgr, seq, tokens + [52, 53])
    assert cached_len(mgr, tokens + [52, 53]) == 10
    mgr.check_integrity([])
