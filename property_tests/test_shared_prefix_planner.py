"""The shared-prefix planner against its contract, on random batches built like the prefix cache builds them.

A batch is drawn as a random prefix tree of block ids: each sequence walks down from the root, reusing a
child chain (shared blocks) or branching into fresh blocks, so equal leading block ids mean equal prefixes,
as in the engine. The contract (`SharedPrefixTiles`): every tile's members hold the same block ids for
``[0, len)``, ``len < context_len`` of each, ``len >= min_shared_len``; a sequence is in at most one tile and
its ``kv_start`` is its tile's ``len`` (else 0); the tile count never exceeds ``max_tiles``; and no pair of
sequences sharing ``min_shared_len`` positions through the keyed block is left out (unless the grid is full).
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from radixinfer.attention.shared_prefix import SharedPrefixPlanner


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_seqs = draw(st.integers(1, 40))
    paths: list[list[int]] = []
    next_block = 1
    for _ in range(num_seqs):
        path: list[int] = []
        length = draw(st.integers(0, 11))
        while len(path) < length:
            siblings = [p for p in paths if p[: len(path)] == path and len(p) > len(path) + 1]
            if siblings and draw(st.booleans()):
                path.append(draw(st.sampled_from(siblings))[len(path)])
            else:
                path.append(next_block)
                next_block += 1
        path.append(next_block)  # the newest position's block: a decoding sequence holds it alone
        next_block += 1
        paths.append(path)
    width = max(map(len, paths)) + 1
    tables = np.zeros((num_seqs + 3, width), dtype=np.int32)  # rows past the batch hold junk
    tables[num_seqs:] = 7
    context_lens = []
    for i, path in enumerate(paths):
        tables[i, : len(path)] = path
        context_lens.append((len(path) - 1) * block_size + draw(st.integers(1, block_size)))
    min_shared_len = draw(st.integers(1, 3 * block_size))
    seqs_per_tile = draw(st.integers(2, 9))
    return tables, np.array(context_lens), block_size, min_shared_len, seqs_per_tile


def plan_and_check(planner, tables, context_lens, complete=True):
    """Plan ``tables``/``context_lens`` with ``planner`` and check the contract; ``complete``: also that no
    pair sharing enough is left out (a fresh plan; a reused one may lag behind sharing that appeared)."""
    n, block_size = len(context_lens), planner.block_size
    min_shared_len, seqs_per_tile = planner.min_shared_len, planner.seqs_per_tile
    max_tiles = planner.max_tiles(n)
    tile_seqs = np.full((max_tiles, seqs_per_tile), 99, dtype=np.int32)
    tile_lens = np.full(max_tiles, 99, dtype=np.int32)
    kv_starts = np.full(n + 2, 99, dtype=np.int32)
    num_tiles = planner.plan(tables, context_lens, tile_seqs, tile_lens, kv_starts)

    assert 0 <= num_tiles <= max_tiles
    assert (tile_lens[num_tiles:] == 0).all()
    assert (kv_starts[n:] == 99).all()  # nothing past the batch is written
    covered = {}
    for t in range(num_tiles):
        members = [s for s in tile_seqs[t] if s >= 0]
        assert list(tile_seqs[t][: len(members)]) == members and len(members) >= 1
        length = int(tile_lens[t])
        assert length >= min_shared_len
        blocks = -(-length // block_size)
        for s in members:
            assert s not in covered, f"sequence {s} in two tiles"
            covered[s] = length
            assert length < context_lens[s]
            assert (tables[s, :blocks] == tables[members[0], :blocks]).all()
    for s in range(n):
        assert kv_starts[s] == covered.get(s, 0)

    # Completeness: two sequences sharing min_shared_len positions (hence the keyed block) end up covered,
    # unless the groups need more tiles than the grid has; then as many groups as fit are kept.
    if not complete or num_tiles > max_tiles - -(-n // seqs_per_tile):
        return
    need = -(-min_shared_len // block_size)
    for a in range(n):
        for b in range(a + 1, n):
            shared_blocks = 0
            while (
                shared_blocks < tables.shape[1]
                and tables[a, shared_blocks] == tables[b, shared_blocks]
            ):
                shared_blocks += 1
            cap = min(context_lens[a], context_lens[b]) - 1
            if shared_blocks >= need and min(shared_blocks * block_size, cap) >= min_shared_len:
                assert a in covered and b in covered, (a, b)


@given(batches())
def test_plan_keeps_the_contract(batch):
    tables, context_lens, block_size, min_shared_len, seqs_per_tile = batch
    plan_and_check(
        SharedPrefixPlanner(block_size, seqs_per_tile, min_shared_len), tables, context_lens
    )


@given(
    batches(),
    st.lists(
        st.tuples(
            st.sampled_from(["swap", "grow", "rebranch", "drop"]),
            st.integers(0, 99),
            st.integers(0, 99),
            st.integers(0, 12),
        ),
        max_size=8,
    ),
)
def test_a_reused_plan_keeps_the_contract_as_the_batch_changes(batch, edits):
    """One planner over consecutive steps: rows swap, grow by a block, get a new request that branches off
    another row's path at some block, or leave; each plan (fresh or reused) must hold for the current batch."""
    tables, context_lens, block_size, min_shared_len, seqs_per_tile = batch
    tables, context_lens = tables.copy(), list(context_lens)
    planner = SharedPrefixPlanner(block_size, seqs_per_tile, min_shared_len)
    plan_and_check(planner, tables, np.array(context_lens))
    fresh = int(tables.max()) + 1
    for op, i, j, depth in edits:
        n = len(context_lens)
        i, j = i % n, j % n
        if op == "swap":
            tables[[i, j]] = tables[[j, i]]
            context_lens[i], context_lens[j] = context_lens[j], context_lens[i]
        elif op == "grow":
            used = -(-context_lens[i] // block_size)
            if used < tables.shape[1]:
                tables[i, used] = fresh
                context_lens[i] = used * block_size + 1
        elif (
            op == "rebranch"
        ):  # a new request in row i: row j's first blocks (its keyed one at least, the
            # case a plan must notice: same key, shorter share), then blocks of its own
            key_col = (min_shared_len - 1) // block_size
            keep = min(
                key_col + 1 + depth, -(-context_lens[j] // block_size) - 1
            )  # never j's newest block
            row = np.zeros(tables.shape[1], dtype=tables.dtype)
            row[:keep] = tables[j, :keep]
            row[keep] = fresh
            tables[i] = row
            context_lens[i] = keep * block_size + 1
        elif op == "drop" and n > 1:
            context_lens.pop()
        fresh += 1
        plan_and_check(planner, tables, np.array(context_lens), complete=False)


def test_groups_by_the_deeper_block_under_a_template_all_share():
    """A 16-position template shared by all, then two 128-position system prompts: two groups, each sharing
    its whole prompt (not one group sharing the template)."""
    block_size, n = 16, 6
    template = [1]
    prompts = {0: list(range(10, 18)), 1: list(range(20, 28))}
    tables = np.zeros((n, 12), dtype=np.int32)
    for s in range(n):
        row = template + prompts[s % 2] + [100 + s]
        tables[s, : len(row)] = row
    context_lens = np.full(n, 9 * 16 + 5)
    planner = SharedPrefixPlanner(block_size, seqs_per_tile=2, min_shared_len=128)
    tile_seqs = np.zeros((planner.max_tiles(n), 2), dtype=np.int32)
    tile_lens = np.zeros(planner.max_tiles(n), dtype=np.int32)
    kv_starts = np.zeros(n, dtype=np.int32)
    assert (
        planner.plan(tables, context_lens, tile_seqs, tile_lens, kv_starts) == 4
    )  # 3 per group, 2 per tile
    assert sorted(map(tuple, tile_seqs[:4].tolist())) == [(0, 2), (1, 3), (4, -1), (5, -1)]
    assert (tile_lens[:4] == 144).all() and (kv_starts == 144).all()


def test_a_full_grid_keeps_the_groups_that_save_the_most():
    """32 pairs, the grid has room for 64 // 9 + 16 = 23 tiles: the 23 pairs sharing the longest prefixes."""
    block_size, n = 16, 64
    tables = np.zeros((n, 42), dtype=np.int32)
    context_lens = np.zeros(n, dtype=np.int64)
    next_block = 1
    for pair in range(32):
        shared_blocks = 9 + pair  # pair p shares (9 + p) * 16 positions
        prefix = list(range(next_block, next_block + shared_blocks))
        next_block += shared_blocks
        for s in (2 * pair, 2 * pair + 1):
            tables[s, : shared_blocks + 1] = prefix + [next_block]
            next_block += 1
            context_lens[s] = shared_blocks * block_size + 3
    planner = SharedPrefixPlanner(block_size, seqs_per_tile=9, min_shared_len=128)
    assert planner.max_tiles(n) == 23
    tile_seqs = np.zeros((23, 9), dtype=np.int32)
    tile_lens = np.zeros(23, dtype=np.int32)
    kv_starts = np.zeros(n, dtype=np.int32)
    assert planner.plan(tables, context_lens, tile_seqs, tile_lens, kv_starts) == 23
    assert sorted(tile_lens.tolist()) == [(9 + p) * 16 for p in range(9, 32)]
    assert (kv_starts[:18] == 0).all() and (kv_starts[18:] > 0).all()


def test_a_plan_is_reused_while_rows_only_grow_and_redone_when_a_member_changes():
    """Four rows share 10 blocks (160 positions). Growing the tails reuses the plan (no fresh grouping); a new
    request in row 2 with the same keyed block but only 9 shared blocks must not keep the 160."""
    block_size = 16
    tables = np.zeros((4, 16), dtype=np.int32)
    shared = list(range(1, 11))
    for s in range(4):
        tables[s, :11] = shared + [100 + s]
    context_lens = np.full(4, 10 * 16 + 5)
    planner = SharedPrefixPlanner(block_size, seqs_per_tile=4, min_shared_len=128)
    fresh_plans = []
    fresh_plan = planner._fresh_plan
    planner._fresh_plan = lambda *args: fresh_plans.append(1) or fresh_plan(*args)
    tile_seqs, tile_lens, kv_starts = (
        np.zeros((4, 4), np.int32),
        np.zeros(4, np.int32),
        np.zeros(4, np.int32),
    )
    assert (
        planner.plan(tables, context_lens, tile_seqs, tile_lens, kv_starts) == 1
        and len(fresh_plans) == 1
    )
    tables[:, 11] = [200, 201, 202, 203]
    context_lens[:] = 11 * 16 + 1
    assert (
        planner.plan(tables, context_lens, tile_seqs, tile_lens, kv_starts) == 1
        and len(fresh_plans) == 1
    )
    assert kv_starts.tolist() == [160] * 4
    tables[2] = 0
    tables[2, :10] = shared[:9] + [300]
    context_lens[2] = 9 * 16 + 1
    planner.plan(tables, context_lens, tile_seqs, tile_lens, kv_starts)
    assert len(fresh_plans) == 2 and kv_starts.tolist() == [144, 144, 144, 144]
