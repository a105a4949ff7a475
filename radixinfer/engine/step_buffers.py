"""The runner's step buffers: the host arrays a forward's inputs are packed into and their device
copies, which double as a CUDA graph's static inputs.

Host data goes to the device in two copies per forward (one int64 buffer: token ids, positions, slots;
one int32 buffer: context lengths, query starts, the extend work list or the shared-prefix tiles, and the
block-table rows that changed, which one scatter writes into the tables kept on the device), never one
small copy per field or request.

Decode keeps its buffers across steps: the block-table rows are rewritten only where a table changed
(`BlockTableRows`), and only the rewritten rows travel to the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from radixinfer.attention import AttentionMetadata, SharedPrefixTiles


def pack_block_tables(tables: Sequence[Sequence[int]], out: np.ndarray) -> None:
    """Write ragged block tables into the rows of ``out`` ``[>= len(tables), width]`` (vectorised: one
    boolean-mask assignment, row-major, so the concatenation lands row by row). Padding entries are 0."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=out.dtype, count=int(lens.sum())
    )
    rows = out[: len(tables)]
    rows[...] = 0
    rows[np.arange(out.shape[1])[None, :] < lens[:, None]] = flat


class BlockTableRows:
    """Block tables packed into the rows of a persistent host array ``[num_rows, width]`` (zeros past each
    table's end), rewritten only where they changed.

    A decode step grows about one table in ``block_size`` by a block and leaves the rest as they were, while
    converting every entry of every table from Python ints costs ~25 ns each (~0.3 ms at 256 x 50 blocks).
    Each row remembers the table it was last written from (the sequence's own list object) and a copy of its
    entries then:

    * a row that holds a different table than before gets it by one numpy gather from the row that held it
      (requests that finish shift every later one up a row) or, if no row held it, from its entries;
    * a row that holds the same table is compared with its copy only when the caller says it may have changed
      (``changed``; None: every row), and a table that grew gets only its new entries written (sequences
      admitted together cross block boundaries on the same step). The comparison is a list comparison, in C,
      mostly of pointer-equal ints, so any edit is caught: growth, a copy-on-write of the last block, a remap.

    Tables must be lists (what the cache hands out). Rows past the batch keep what they held.
    """

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows  # [num_rows, width] int32, zero-filled by the caller
        num_rows = rows.shape[0]
        self._held: list[list[int] | None] = [
            None
        ] * num_rows  # row -> the table object it was written from
        self._written: list[list[int]] = [
            [] for _ in range(num_rows)
        ]  # row -> the entries written there

    def update(
        self, tables: Sequence[list[int]], changed: Sequence[int] | None = None
    ) -> tuple[list[int], int]:
        """Make rows ``0 .. len(tables) - 1`` hold ``tables``. Returns the rows rewritten (ascending) and how many
        leading entries of them may differ from before (the rest of each is zero, as it was).

        ``changed``: the rows whose table, if the row held it before, may have been edited since (the caller
        vouches for the others); None: any of them."""
        rows, held, written = self.rows, self._held, self._written
        rewritten: set[int] = set()
        width = 0
        stale = [i for i, table in enumerate(tables) if held[i] is not table]
        if stale:
            row_of = {id(table): row for row, table in enumerate(held) if table is not None}
            sources = [row_of.get(id(tables[i]), -1) for i in stale]
            old_lens = [len(written[i]) for i in stale]
            moved = [(i, j) for i, j in zip(stale, sources) if j >= 0]
            if moved:
                dst, src = map(list, zip(*moved))
                moved_written = [written[j] for j in src]
                # Past the longer of the two contents both rows are zeros: copy up to there only (a row is as
                # wide as the model's context, 2,048 blocks for a 32k one). The right side is a copy: rows
                # may trade places.
                cols = max(max(map(len, moved_written)), max([len(written[i]) for i in dst]))
                rows[dst, :cols] = rows[src, :cols]
                for j in src:
                    held[j] = None  # a source past the batch no longer stands for its table
                for i, entries in zip(dst, moved_written):
                    written[i] = entries
            for i, source, old_len in zip(stale, sources, old_lens):
                table = tables[i]
                held[i] = table
                if source < 0:
                    n = len(table)
                    rows[i, :n] = table
                    if old_len > n:
                        rows[i, n:old_len] = 0
                    written[i] = table.copy()
                width = max(width, old_len, len(written[i]))
            rewritten.update(stale)
        for i in range(len(tables)) if changed is None else changed:
            table, old = tables[i], written[i]
            if old != table:
                n, m = len(table), len(old)
                if (
                    m < n and table[:m] == old
                ):  # grown by blocks (the common change): write just those
                    if n == m + 1:
                        rows[i, m] = table[m]
                    else:
                        rows[i, m:n] = table[m:]
                    old.extend(table[m:])
                else:
                    rows[i, :n] = table
                    if m > n:
                        rows[i, n:m] = 0
                    written[i] = table.copy()
                rewritten.add(i)
                width = max(width, n, m)
        return sorted(rewritten), width


def _copy_from_snapshot(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` that may run later on the stream (behind a long prefill graph, say) while the host
    already rewrites ``src`` for the next step: on CUDA the copy reads a pinned snapshot of ``src``, which
    the caching host allocator does not hand out again until the copies reading it have run."""
    if dst.device.type != "cuda":
        dst.copy_(src)
        return
    snapshot = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    snapshot.copy_(src)
    dst.copy_(snapshot, non_blocking=True)


class StepBuffers:
    """Host and device buffers for up to ``max_tokens`` tokens / ``max_seqs`` sequences. The device tensors
    double as a CUDA graph's static inputs; the host arrays are filled in place every step (`upload` sends
    a snapshot of them).

    The int32 buffer is laid out ``[context_lens (max_seqs) | query_start (max_seqs + 1) | extend work list
    (2 x max_work) | shared-prefix tiles: kv_starts (max_seqs), lens (max_tiles), seqs (max_tiles x
    seqs_per_tile) | staged table rows (max_seqs x width) | tables (max_seqs x width)]`` (no tile part when
    ``max_tiles`` is 0). The block tables live on the device: the host keeps their mirror (``tables``) and
    sends only the rows `stage_rows` names, each cut to the widest of them, so a step that grows a few tables
    moves a few rows and not ``max_seqs x width`` entries (4 MB per step for a 32k-context model at batch 512,
    ~80 us of the copy engine ahead of every step). `upload` copies one prefix of the int32 buffer, up to the
    staged rows, and scatters those into the device tables."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        width: int,
        device: torch.device,
        max_tiles: int = 0,
        seqs_per_tile: int = 0,
        max_work: int = 0,
    ) -> None:
        sizes = {  # the int32 layout, in order; one definition for the host and the device views
            "context_lens": max_seqs,
            "query_start": max_seqs + 1,
            "work": 2 * max_work,
            "kv_starts": max_seqs if max_tiles else 0,
            "tile_lens": max_tiles,
            "tile_seqs": max_tiles * seqs_per_tile,
            "staged": max_seqs * width,
            "tables": max_seqs * width,
        }
        ends = dict(zip(sizes, itertools.accumulate(sizes.values())))
        self._spans = {name: slice(ends[name] - size, ends[name]) for name, size in sizes.items()}
        # ids, positions, slots, (decode) the row of each sequence's input in the previous step's tokens, and
        # the table row of each staged row
        self.host64 = torch.zeros(5, max(max_tokens, max_seqs), dtype=torch.int64)
        self.host32 = torch.zeros(ends["tables"], dtype=torch.int32)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.width, self.max_seqs, self.seqs_per_tile, self.max_work = (
            width,
            max_seqs,
            seqs_per_tile,
            max_work,
        )
        h64, h32 = self.host64.numpy(), self.host32.numpy()
        self.ids, self.positions, self.slots, self.carry_rows, self._staged_rows = h64
        self.context_lens, self.query_start, self.kv_starts, self.tile_lens = (
            h32[self._spans[name]]
            for name in ("context_lens", "query_start", "kv_starts", "tile_lens")
        )
        self.tile_seqs = h32[self._spans["tile_seqs"]].reshape(max_tiles, seqs_per_tile)
        self.work = h32[self._spans["work"]].reshape(2, max_work)
        self.tables = h32[self._spans["tables"]].reshape(max_seqs, width)
        self._staged = (0, 0)  # (rows, width) staged for the next upload

    def _dev(self, name: str) -> torch.Tensor:
        return self.dev32[self._spans[name]]

    @property
    def device_tables(self) -> torch.Tensor:  # [max_seqs, width] int32, what the kernels read
        return self._dev("tables").view(self.max_seqs, self.width)

    def pack_prefill(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        query_lens: np.ndarray,
        padded_to: int,
    ) -> None:
        """Fill the host buffers with a ragged prefill pass (see `ModelRunner.prefill`), its tokens
        padded up to ``padded_to`` with tokens that store nothing (and no work item reads them), and
        stage every table, cut to the longest."""
        num_tokens, num_seqs = len(input_ids), len(tables)
        width = max(map(len, tables))
        self.ids[:num_tokens] = input_ids
        self.positions[:num_tokens] = positions
        self.slots[:num_tokens] = slots
        self.slots[num_tokens:padded_to] = -1
        pack_block_tables(tables, self.tables[:, :width])  # only the columns this pass sends
        self.stage_rows(range(num_seqs), width)
        self.context_lens[:num_seqs] = context_lens
        self.query_start[0] = 0
        np.cumsum(query_lens, out=self.query_start[1 : num_seqs + 1])

    def pack_decode(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        context_lens: Sequence[int],
        carried_rows: Sequence[int] | None,
        padded_to: int,
    ) -> None:
        """Fill the host buffers with a decode step of one token per sequence (see
        `ModelRunner.decode`; the tables are staged apart), its rows padded up to ``padded_to`` with
        rows that store nothing and attend to nothing."""
        n = len(input_ids)
        self.ids[:n] = input_ids
        if carried_rows is not None:
            self.carry_rows[:n] = carried_rows
        self.positions[:n] = positions
        self.slots[:n] = slots
        self.slots[n:padded_to] = -1
        self.context_lens[:n] = context_lens
        self.context_lens[n:padded_to] = 0

    def make_idle(self) -> None:
        """Send inputs that do nothing: no slot stored, no context, no shared-prefix tile, every
        work item idle (what a CUDA graph is captured on)."""
        self.slots[:] = -1
        self.context_lens[:] = 0
        self.tile_lens[:] = 0
        self.work[1] = -1
        self.upload()

    def stage_rows(self, rows: Sequence[int], width: int) -> None:
        """Send these rows of the host tables, their first ``width`` entries (the rest of each row must be
        unchanged since its last send), with the next `upload`."""
        count = len(rows)
        self._staged_rows[:count] = rows
        staged = self.host32.numpy()[self._spans["staged"]][: count * width].reshape(count, width)
        staged[...] = self.tables[self._staged_rows[:count], :width]
        self._staged = (count, width)

    def upload(self) -> None:
        """Copy the host buffers to the device and the staged rows into the device tables, asynchronously:
        the host may fill the buffers for the next step at once."""
        count, width = self._staged
        end = self._spans["staged"].start + count * width
        _copy_from_snapshot(self.dev64, self.host64)
        _copy_from_snapshot(self.dev32[:end], self.host32[:end])
        if count:
            staged = self.dev32[self._spans["staged"].start : end].view(count, width)
            self.device_tables[:, :width].index_copy_(0, self.dev64[4, :count], staged)
        self._staged = (0, 0)

    def metadata(
        self,
        num_tokens: int,
        num_seqs: int,
        max_query_len: int,
        max_context_len: int,
        num_tiles: int = 0,
        num_work: int = 0,
        new_slots_private: bool = False,
    ) -> AttentionMetadata:
        """``num_tiles`` > 0: decode reads shared prefixes through the first ``num_tiles`` tiles (the grid;
        tiles past what the planner filled have length 0). ``num_work``: the extend kernel's grid, the first
        ``num_work`` items of the work list (items past the plan are idle). ``new_slots_private``: a
        decode step's (`AttentionMetadata.new_slots_private`)."""
        shared = None
        if num_tiles:
            shared = SharedPrefixTiles(
                seqs=self._dev("tile_seqs").view(-1, self.seqs_per_tile)[:num_tiles],
                lens=self._dev("tile_lens")[:num_tiles],
                kv_starts=self._dev("kv_starts")[:num_seqs],
            )
        return AttentionMetadata(
            slot_mapping=self.dev64[2, :num_tokens],
            block_tables=self.device_tables[:num_seqs],
            context_lens=self._dev("context_lens")[:num_seqs],
            query_start_loc=self._dev("query_start")[: num_seqs + 1],
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            shared_prefix=shared,
            extend_work=self._dev("work").view(2, self.max_work)[:, :num_work]
            if num_work
            else None,
            new_slots_private=new_slots_private,
        )
