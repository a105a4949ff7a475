"""The shared-prefix planner against its contract, on random batches built like the prefix cache builds them.

A batch is drawn as a random prefix tree of block ids: each sequence walks down from the root, reusing a
child chain (shared blocks) or branching into fresh blocks, so equal leading block ids mean equal prefixes,
as in the engine. The contract (`SharedPrefixTiles`): every tile's members hold the same block ids for
``[0, len)``, ``len < context_len`` of each, ``len >= min_shared_len``; a sequence is in at most one tile and
its ``kv_start`` is its tile's ``len`` (else 0); the tile count never exceeds ``max_tiles``; and no pair of
sequences sharing ``min_shared_len`` positions through the keyed block is left out.
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


@given(batches())
def test_plan_keeps_the_contract(batch):
    tables, context_lens, block_size, min_shared_len, seqs_per_tile = batch
    n = len(context_lens)
    planner = SharedPrefixPlanner(block_size, seqs_per_tile, min_shared_len)
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

    # Completeness: two sequences sharing min_shared_len positions (hence the keyed block) end up covered.
    need = -(-min_shared_len // block_size)
    for a in range(n):
        for b in range(a + 1, n):
            shared_blocks = 0
            while shared_blocks < tables.shape[1] and tables[a, shared_blocks] == tables[b, shared_blocks]:
                shared_blocks += 1
            cap = min(context_lens[a], context_lens[b]) - 1
            if shared_blocks >= need and min(shared_blocks * block_size, cap) >= min_shared_len:
                assert a in covered and b in covered, (a, b)


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
    assert planner.plan(tables, context_lens, tile_seqs, tile_lens, kv_starts) == 4  # 3 per group, 2 per tile
    assert sorted(map(tuple, tile_seqs[:4].tolist())) == [(0, 2), (1, 3), (4, -1), (5, -1)]
    assert (tile_lens[:4] == 144).all() and (kv_starts == 144).all()
