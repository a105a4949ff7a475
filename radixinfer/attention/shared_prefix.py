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
3. groups of two or more sharing at least ``min_shared_len`` positions are cut into tiles.

What it does not find: a group sharing less than ``min_shared_len`` (the tile kernel's fixed cost would
outweigh the bytes saved), and a second, deeper level of sharing inside a group (read per sequence).
"""

from __future__ import annotations

import numpy as np

MIN_SHARED_LEN = 128  # positions; two KV tiles of the kernel: below this a tile saves too little to pay off


class SharedPrefixPlanner:
    """Lays out `SharedPrefixTiles` for a decode batch into host arrays the caller owns (and uploads).

    ``seqs_per_tile`` comes from ``kernels.paged_attention.shared_prefix_seqs_per_tile`` for the model's head
    layout and dtype; below 2 a tile cannot share anything and `plan` always returns 0.
    """

    def __init__(self, block_size: int, seqs_per_tile: int, min_shared_len: int = MIN_SHARED_LEN) -> None:
        if min_shared_len < 1:
            raise ValueError(f"min_shared_len must be >= 1, got {min_shared_len}")
        self.block_size = block_size
        self.seqs_per_tile = seqs_per_tile
        self.min_shared_len = min_shared_len

    def max_tiles(self, num_seqs: int) -> int:
        """An upper bound of `plan`'s tile count for ``num_seqs`` sequences (the grid a CUDA graph captures):
        groups have two members or more and ``ceil(m / S) < m / S + 1``, so tiles < n / S + n / 2."""
        return num_seqs // max(self.seqs_per_tile, 1) + num_seqs // 2 + 1

    def plan(
        self,
        tables: np.ndarray,  # [>= n, width] int32 block tables, rows 0..n-1 are the batch
        context_lens: np.ndarray,  # [n] ints
        tile_seqs: np.ndarray,  # out: [max_tiles(n) or more, seqs_per_tile] int32
        tile_lens: np.ndarray,  # out: [same number of tiles] int32; every entry is written (0 = idle)
        kv_starts: np.ndarray,  # out: [n] int32
    ) -> int:
        """Fill the tile arrays for the batch and return the number of tiles used (0: nothing worth it)."""
        n, size = len(context_lens), self.seqs_per_tile
        tile_lens[:] = 0
        kv_starts[:n] = 0
        if n < 2 or size < 2:
            return 0
        context_lens = np.asarray(context_lens)
        key_col = (self.min_shared_len - 1) // self.block_size
        candidates = np.flatnonzero(context_lens > self.min_shared_len)
        if len(candidates) < 2:
            return 0
        order = candidates[np.argsort(tables[candidates, key_col], kind="stable")]
        keys = tables[order, key_col]
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        sizes = np.diff(np.append(starts, len(order)))
        in_pair = np.repeat(sizes >= 2, sizes)
        if not in_pair.any():
            return 0
        order, sizes = order[in_pair], sizes[sizes >= 2]
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))

        lens = context_lens[order]
        cols = min(tables.shape[1], int(lens.max() - 2) // self.block_size + 1)  # blocks below every newest position
        leaders = np.repeat(order[starts], sizes)
        same = np.logical_and.reduceat(tables[order, :cols] == tables[leaders, :cols], starts, axis=0)  # [G, cols]
        common_blocks = np.where(same.all(axis=1), cols, same.argmin(axis=1))
        shared = np.minimum(common_blocks * self.block_size, np.minimum.reduceat(lens, starts) - 1)

        num_tiles = 0
        for g in np.flatnonzero(shared >= self.min_shared_len):
            members = order[starts[g] : starts[g] + sizes[g]]
            kv_starts[members] = shared[g]
            for first in range(0, len(members), size):
                chunk = members[first : first + size]
                tile_seqs[num_tiles, : len(chunk)] = chunk
                tile_seqs[num_tiles, len(chunk) :] = -1
                tile_lens[num_tiles] = shared[g]
                num_tiles += 1
        return num_tiles
