"""Per decode step: which sequences share a cached prefix, so that decode attention reads it once per tile.

The prefix cache hands every request holding a prefix the same physical blocks for it, so a decode batch of
requests that share a system prompt has block tables with equal leading block ids. Decode is bound by KV
bytes read: at batch 512 with a 1,024-token prompt shared per group of 32, the shared positions are 84% of
what each step reads. The Triton decode path (kernels/paged_attention.py, ``SharedPrefixTiles``) reads a
shared prefix once for a tile of up to ``seqs_per_tile`` sequences, and each sequence's own tail alone.

Grouping, on the host, vectorised over the batch (numpy), from the block tables alone:

1. key each sequence by the block id holding position ``min_shared_len - 1``: sequences sharing at least
   ``min_shared_len`` positions have the same key (a few levels of a tree: a chat template shared by all and
   system prompts shared per group key by the deeper, per-group block);
2. within a key, the shared length is the number of leading block ids all members have in common, times the
   block size, capped below every member's context length (its newest position is its own);
3. groups of two or more sharing at least ``min_shared_len`` positions are cut into tiles (as many as the
   grid has room for, the groups that save the most first).

What it does not find: a group sharing less than ``min_shared_len`` (the tile kernel's fixed cost would
outweigh the bytes saved), and a second, deeper level of sharing inside a group (read per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_SHARED_LEN = (
    128  # positions; two KV tiles of the kernel: below this a tile saves too little to pay off
)
EXTRA_TILES = 16  # partial tiles the grid has room for beyond the full ones (see `max_tiles`)


@dataclass(frozen=True)
class _Plan:
    """A batch's tiles, and the signature under which they still hold (see `SharedPrefixPlanner.plan`)."""

    num_seqs: int
    keys: np.ndarray  # [n] each row's keyed block
    long_enough: np.ndarray  # [n] bool: context > min_shared_len
    rows: np.ndarray  # [m] the rows in tiles ...
    cols: np.ndarray  # [m] ... the column of each one's last shared block ...
    blocks: np.ndarray  # [m] ... and that block's id
    tile_seqs: np.ndarray  # [num_tiles, seqs_per_tile] int32, -1 = none
    tile_lens: np.ndarray  # [num_tiles] int32
    kv_starts: np.ndarray  # [n] int32


class SharedPrefixPlanner:
    """Lays out `SharedPrefixTiles` for a decode batch into host arrays the caller owns (and uploads).

    ``seqs_per_tile`` comes from ``kernels.paged_attention.shared_prefix_seqs_per_tile`` for the model's head
    layout and dtype; below 2 a tile cannot share anything and `plan` always returns 0.
    """

    def __init__(
        self, block_size: int, seqs_per_tile: int, min_shared_len: int = MIN_SHARED_LEN
    ) -> None:
        if min_shared_len < 1:
            raise ValueError(f"min_shared_len must be >= 1, got {min_shared_len}")
        self.block_size = block_size
        self.seqs_per_tile = seqs_per_tile
        self.min_shared_len = min_shared_len
        self._last: _Plan | None = None

    def max_tiles(self, num_seqs: int) -> int:
        """The most tiles `plan` lays out for ``num_seqs`` sequences (the grid a CUDA graph captures). Every
        group fits when there are few partial tiles: ``n // S`` full ones plus ``max(16, n // 8)`` (groups
        have two members or more, so no plan needs more than ``n // S + n // 2 + 1``). Past that the grid would
        be mostly idle programs, which are not free; `plan` then keeps the groups that save the most."""
        full = num_seqs // max(self.seqs_per_tile, 1)
        return min(full + num_seqs // 2 + 1, full + max(EXTRA_TILES, num_seqs // 8))

    def plan(
        self,
        tables: np.ndarray,  # [>= n, width] int32 block tables, rows 0..n-1 are the batch
        context_lens: np.ndarray,  # [n] ints
        tile_seqs: np.ndarray,  # out: [max_tiles(n) or more, seqs_per_tile] int32
        tile_lens: np.ndarray,  # out: [same number of tiles] int32; every entry is written (0 = idle)
        kv_starts: np.ndarray,  # out: [n] int32
    ) -> int:
        """Fill the tile arrays for the batch and return the number of tiles used (0: nothing worth it).

        Consecutive decode steps mostly keep the same sequences in the same rows, so the last plan is reused
        while its signature holds: the batch size, each row's keyed block and whether its context is long
        enough, and each covered row's last shared block. Reuse is exact: equal block ids at a column mean
        equal token prefixes through it (a block is shared only along the one token path it holds), so the
        members still share ``[0, len)``; it may only miss sharing that appeared since (until a row changes).
        """
        n = len(context_lens)
        # a row long enough has its keyed block inside the table; clipping only touches rows that are not
        keys = tables[:n, min((self.min_shared_len - 1) // self.block_size, tables.shape[1] - 1)]
        long_enough = np.asarray(context_lens) > self.min_shared_len
        last = self._last
        if not (
            last is not None
            and last.num_seqs == n
            and np.array_equal(last.keys, keys)
            and np.array_equal(last.long_enough, long_enough)
            and np.array_equal(tables[last.rows, last.cols], last.blocks)
        ):
            last = self._last = self._fresh_plan(
                tables, np.asarray(context_lens), keys.copy(), long_enough
            )
        num_tiles = len(last.tile_lens)
        tile_lens[:] = 0
        tile_lens[:num_tiles] = last.tile_lens
        tile_seqs[:num_tiles] = last.tile_seqs
        kv_starts[:n] = last.kv_starts
        return num_tiles

    def _fresh_plan(
        self,
        tables: np.ndarray,
        context_lens: np.ndarray,
        keys: np.ndarray,
        long_enough: np.ndarray,
    ) -> _Plan:
        n, size = len(context_lens), self.seqs_per_tile
        none = _Plan(
            n,
            keys,
            long_enough,
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, tables.dtype),
            np.zeros((0, size), np.int32),
            np.zeros(0, np.int32),
            np.zeros(n, np.int32),
        )
        candidates = np.flatnonzero(long_enough)
        if len(candidates) < 2 or size < 2:
            return none
        order = candidates[np.argsort(keys[candidates], kind="stable")]
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1])))
        sizes = np.diff(np.append(starts, len(order)))
        in_pair = np.repeat(sizes >= 2, sizes)
        if not in_pair.any():
            return none
        order, sizes = order[in_pair], sizes[sizes >= 2]
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))

        lens = context_lens[order]
        cols = min(
            tables.shape[1], int(lens.max() - 2) // self.block_size + 1
        )  # blocks below every newest position
        leaders = np.repeat(order[starts], sizes)
        same = np.logical_and.reduceat(
            tables[order, :cols] == tables[leaders, :cols], starts, axis=0
        )  # [G, cols]
        common_blocks = np.where(same.all(axis=1), cols, same.argmin(axis=1))
        shared = np.minimum(common_blocks * self.block_size, np.minimum.reduceat(lens, starts) - 1)

        use = np.flatnonzero(shared >= self.min_shared_len)
        tiles_needed = -(-sizes[use] // size)
        if tiles_needed.sum() > self.max_tiles(n):  # keep the groups that save the most reads
            by_saving = np.argsort(-(sizes[use] - tiles_needed) * shared[use], kind="stable")
            kept = by_saving[np.cumsum(tiles_needed[by_saving]) <= self.max_tiles(n)]
            use, tiles_needed = use[kept], tiles_needed[kept]
        if len(use) == 0:
            return none
        # vectorised layout: member i of a kept group goes to tile first_tile[g] + i // size, slot i % size
        members = order[np.repeat(np.isin(np.arange(len(sizes)), use), sizes)]
        member_sizes = sizes[use]
        index_in_group = np.arange(len(members)) - np.repeat(
            np.cumsum(member_sizes) - member_sizes, member_sizes
        )
        first_tile = np.cumsum(tiles_needed) - tiles_needed
        tile_seqs = np.full((int(tiles_needed.sum()), size), -1, dtype=np.int32)
        tile_seqs[
            np.repeat(first_tile, member_sizes) + index_in_group // size, index_in_group % size
        ] = members
        kv_starts = np.zeros(n, dtype=np.int32)
        kv_starts[members] = np.repeat(shared[use], member_sizes)
        last_shared_col = (
            kv_starts[members] - 1
        ) // self.block_size  # the block holding position len - 1
        return _Plan(
            n,
            keys,
            long_enough,
            members,
            last_shared_col,
            tables[members, last_shared_col],
            tile_seqs,
            np.repeat(shared[use], tiles_needed).astype(np.int32),
            kv_starts,
        )
