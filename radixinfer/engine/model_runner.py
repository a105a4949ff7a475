"""Turns a planned batch (token ids, positions, slots, block tables) into one forward of the model.

Host data goes to the device in two copies per forward (one int64 buffer: token ids, positions, slots;
one int32 buffer: context lengths, query starts, the extend work list or the shared-prefix tiles, and the
block-table rows that changed, which one scatter writes into the tables kept on the device), never one
small copy per field or request.
On CUDA, decode steps replay CUDA graphs captured per batch-size bucket: a small model's decode step is
hundreds of kernel launches, and launching them from Python costs far more than running them.

Prefill passes replay CUDA graphs too, captured per token bucket (`prefill_graph_token_counts`) for a fixed
number of sequences: the pass is padded with tokens that store nothing and belong to no sequence, and the
extend kernel's grid is its work list's capacity (`plan_extend_work`), so it does not depend on how the
tokens split among the sequences. An eager pass of a small model spends milliseconds launching kernels
that run in a fraction of that; passes beyond the largest bucket run eagerly (there the GPU time dominates).

Decode keeps its buffers across steps: the block-table rows are rewritten only where a table changed
(`BlockTableRows`), and only the rewritten rows travel to the device. With a backend that can, each step
also plans which sequences share a cached prefix (`SharedPrefixPlanner`, from the block-table rows) so that
attention reads it once per tile of sequences; such steps replay the graph variant that does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from kernels.paged_attention import (
    SharedPrefixTiles,
    extend_block_m,
    plan_extend_work,
    shared_prefix_seqs_per_tile,
)
from radixinfer.attention import AttentionBackend, AttentionMetadata, ForwardContext
from radixinfer.attention.shared_prefix import MIN_SHARED_LEN, SharedPrefixPlanner
from radixinfer.cache.kv_store import KVStore
from radixinfer.engine.memory import DeviceMemory, ProfiledMemory
from radixinfer.engine.sampler import SamplingBatch, sample
from radixinfer.models.base import PagedCausalLM


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
                cols = max(max(map(len, moved_written)), max(len(written[i]) for i in dst))
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


# Prefill passes above this many tokens run eagerly: their GPU time dwarfs the launches, and a graph's
# activations would hold that much more memory.
MAX_PREFILL_GRAPH_TOKENS = 16384


def prefill_graph_token_counts(max_tokens: int) -> list[int]:
    """Token buckets a prefill pass is padded up to: four per doubling from 64 (padding adds at most a quarter
    of a pass's tokens), up to the first that holds ``max_tokens`` or `MAX_PREFILL_GRAPH_TOKENS`."""
    sizes = [64]
    while sizes[-1] < min(max_tokens, MAX_PREFILL_GRAPH_TOKENS):
        sizes.append(sizes[-1] + (1 << (sizes[-1].bit_length() - 1)) // 4)
    return sizes


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Buckets a decode batch is padded up to: fine-grained where small batches are common."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


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


class _StepBuffers:
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
    ) -> AttentionMetadata:
        """``num_tiles`` > 0: decode reads shared prefixes through the first ``num_tiles`` tiles (the grid;
        tiles past what the planner filled have length 0). ``num_work``: the extend kernel's grid, the first
        ``num_work`` items of the work list (items past the plan are idle)."""
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
        )


class ModelRunner:
    """Owns the model, the KV tensors and the attention backend.

    ``prefill_max_tokens`` / ``prefill_max_seqs``: the largest prefill pass the engine plans (its token budget
    plus one recomputed position per cached prompt, and its requests per round plus a continuing chunk); the
    prefill graphs and buffers are sized for it, and a larger pass runs eagerly in buffers of its
    own. ``max_context_len``: the longest sequence served (None: the model's context); block tables
    and the decode graphs' split counts are sized by it.

    ``kv`` None: the runner starts on a scratch store of one block (``block_size`` tokens) and
    captures no graph, for `profile_memory`; `bind_kv` then gives it its pool. A store given here is
    bound at once."""

    def __init__(
        self,
        model: PagedCausalLM,
        kv: KVStore | None,
        backend: AttentionBackend,
        device: torch.device,
        max_batch_size: int,
        use_cuda_graphs: bool | None = None,
        prefill_max_tokens: int = 8192,
        prefill_max_seqs: int = 64,
        max_context_len: int | None = None,
        block_size: int | None = None,
    ) -> None:
        if kv is None and block_size is None:
            raise ValueError("ModelRunner needs a KV store, or the block size of the one to come")
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = kv.k.shape[2] if kv is not None else block_size
        self.max_context_len = min(model.max_context_len, max_context_len or model.max_context_len)
        self.table_width = -(-self.max_context_len // self.block_size)
        self.max_batch_size = max_batch_size
        self.prefill_max_tokens, self.prefill_max_seqs = prefill_max_tokens, prefill_max_seqs
        dtype = next(model.parameters()).dtype
        self.kv = (
            kv
            if kv is not None
            else KVStore(
                model.num_layers,
                1,
                self.block_size,
                model.num_kv_heads,
                model.head_dim,
                dtype,
                device,
            )
        )
        self._planner: SharedPrefixPlanner | None = None
        seqs_per_tile = shared_prefix_seqs_per_tile(model.num_heads, model.num_kv_heads, dtype)
        if backend.reads_shared_prefixes_once and seqs_per_tile >= 2:
            self._planner = SharedPrefixPlanner(self.block_size, seqs_per_tile)
        max_tiles = self._planner.max_tiles(max_batch_size) if self._planner else 0
        self._decode_buffers = _StepBuffers(
            max_batch_size, max_batch_size, self.table_width, device, max_tiles, seqs_per_tile
        )
        self._decode_buffers.query_start[:] = np.arange(
            max_batch_size + 1
        )  # one token per sequence
        self._decode_tables = BlockTableRows(self._decode_buffers.tables)
        self._block_m = extend_block_m(dtype)
        self._prefill_sizes = prefill_graph_token_counts(prefill_max_tokens)
        self._prefill_buffers = self._prefill_step_buffers(
            self._prefill_sizes[-1], prefill_max_seqs, self.table_width
        )
        # (batch bucket, reads shared prefixes once) -> (graph, its logits)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_sizes: list[int] = []
        self._prefill_graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, torch.Tensor]
        ] = {}  # tokens -> (graph, hidden)
        # every graph's output lives in one of these (replays never overlap): [max_batch_size,
        # vocab] logits and [largest prefill bucket, hidden] hidden states
        self._graph_outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._capture_stream: torch.cuda.Stream | None = None
        if use_cuda_graphs is None:
            use_cuda_graphs = device.type == "cuda"
        self.use_cuda_graphs = use_cuda_graphs
        if kv is not None and use_cuda_graphs:
            self._capture_graphs()

    def bind_kv(self, kv: KVStore) -> None:
        """Serve from ``kv`` (same block size) from now on; the graphs, which hold the old store's
        addresses, are captured again against it."""
        if kv.k.shape[2] != self.block_size:
            raise ValueError(
                f"the KV store's block size {kv.k.shape[2]} is not the runner's {self.block_size}"
            )
        self._release_graphs()
        self.kv = kv
        if self.use_cuda_graphs:
            self._capture_graphs()

    # ------------------------------------------------------------------ memory profile
    @torch.inference_mode()
    def profile_memory(self) -> ProfiledMemory:
        """Measure what this runner needs beside its KV pool (CUDA only; see
        `radixinfer.engine.memory`).

        With CUDA graphs, every graph is captured against the current store (the scratch one: call
        this before `bind_kv`) and the device memory the capture holds is the graph figure. Then
        `run_worst_case_step` runs as the engine would run it (through the graphs when there are
        some), and its peak allocation above what was allocated before it is the activation figure.
        The graphs are released again before returning, and the allocator's cache emptied."""
        if self.device.type != "cuda":
            raise ValueError(f"profile_memory measures CUDA memory, not {self.device} memory")
        self._release_graphs()
        before = DeviceMemory.read(self.device)
        if self.use_cuda_graphs:
            self._capture_graphs()
        captured = DeviceMemory.read(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_worst_case_step()
        torch.cuda.synchronize(self.device)
        profiled = ProfiledMemory(
            activation_bytes=torch.cuda.max_memory_allocated(self.device) - captured.allocated,
            activation_reserved_bytes=(
                torch.cuda.max_memory_reserved(self.device) - captured.reserved
            ),
            cuda_graph_bytes=captured.used - before.used,
        )
        self._release_graphs()
        return profiled

    @torch.inference_mode()
    def run_worst_case_step(self) -> None:
        """The largest step this runner is sized for, on whatever its store holds (the outputs are
        meaningless; nothing is stored: every slot is -1 and every table reads block 0):

        1. a prefill pass of ``prefill_max_tokens`` over ``prefill_max_seqs`` sequences (each at
           most ``max_context_len`` long), then the LM head and the sampler on every sequence's
           last row;
        2. a decode step of ``max_batch_size`` sequences, one at the longest context and the
           others sharing a prefix (the decode attention's largest workspace), then the sampler on
           every row.

        The sampler runs with temperature, top-k and top-p on every row, its most expensive mode."""
        seqs = self.prefill_max_seqs
        tokens = min(max(self.prefill_max_tokens, seqs), seqs * self.max_context_len)
        query_lens = np.full(seqs, tokens // seqs, dtype=np.int64)
        query_lens[: tokens % seqs] += 1
        positions = np.concatenate([np.arange(n) for n in query_lens])
        tables = [[0] * -(-int(n) // self.block_size) for n in query_lens]
        ids = np.zeros(tokens, np.int64)
        hidden = self.prefill(ids, positions, [-1] * tokens, tables, query_lens, query_lens)
        last_rows = torch.as_tensor(np.cumsum(query_lens) - 1, device=self.device)
        self._sample_worst_case(self.logits(hidden[last_rows]))
        del hidden
        n = self.max_batch_size
        context_lens = np.full(n, min(self.max_context_len, 2 * MIN_SHARED_LEN), dtype=np.int64)
        context_lens[0] = self.max_context_len
        tables = [[0] * -(-int(c) // self.block_size) for c in context_lens]
        ids = np.zeros(n, np.int64)
        logits = self.decode(ids, context_lens - 1, [-1] * n, tables, context_lens)
        self._sample_worst_case(logits)

    def _sample_worst_case(self, logits: torch.Tensor) -> None:
        rows = logits.shape[0]
        ones, zeros = [1.0] * rows, [0] * rows  # temperatures; seeds and steps
        batch = SamplingBatch.build(ones, [0.9] * rows, [50] * rows, zeros, zeros, self.device)
        sample(logits, batch)

    # ------------------------------------------------------------------ prefill
    def _prefill_step_buffers(self, max_tokens: int, max_seqs: int, width: int) -> _StepBuffers:
        return _StepBuffers(
            max_tokens,
            max_seqs,
            width,
            self.device,
            max_work=-(-max_tokens // self._block_m) + max_seqs,
        )

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
    ) -> torch.Tensor:
        """One ragged forward. Sequence ``b`` contributes ``query_lens[b]`` consecutive tokens ending at
        position ``context_lens[b] - 1``; ``slots`` has one entry per token (-1 = already stored).
        Returns the final hidden states ``[num_tokens, hidden_size]``: on CUDA a view into a graph's output,
        valid until the next prefill."""
        num_tokens, num_seqs = len(input_ids), len(tables)
        width = max(map(len, tables))
        buf = self._prefill_buffers
        bucket = (
            next((t for t in self._prefill_sizes if t >= num_tokens), 0)
            if num_seqs <= buf.max_seqs
            else 0
        )
        if not bucket:  # larger than any planned pass: buffers of its own
            buf = self._prefill_step_buffers(num_tokens, num_seqs, width)
        buf.ids[:num_tokens] = input_ids
        buf.positions[:num_tokens] = positions
        buf.slots[:num_tokens] = slots
        buf.slots[
            num_tokens:bucket
        ] = -1  # padding tokens store nothing (and no work item reads them)
        pack_block_tables(tables, buf.tables[:, :width])  # only the columns this pass sends
        buf.stage_rows(range(num_seqs), width)
        buf.context_lens[:num_seqs] = context_lens
        buf.query_start[0] = 0
        query_lens = np.asarray(query_lens)
        np.cumsum(query_lens, out=buf.query_start[1 : num_seqs + 1])
        num_work = plan_extend_work(
            query_lens, buf.context_lens[:num_seqs], self._block_m, buf.work
        )
        buf.upload()
        graph = self._prefill_graphs.get(bucket)
        if graph is not None:
            graph[0].replay()
            return graph[1][:num_tokens]
        meta = buf.metadata(
            num_tokens, num_seqs, int(query_lens.max()), max(context_lens), num_work=num_work
        )
        return self.model(
            buf.dev64[0, :num_tokens],
            buf.dev64[1, :num_tokens],
            ForwardContext(meta, self.kv.k, self.kv.v, self.backend),
        )

    def _prefill_graph_forward(self, num_tokens: int) -> torch.Tensor:
        """The forward a prefill graph of ``num_tokens`` captures: every sequence slot of the buffers, the whole
        work list (its grid), ``max_query_len`` at the bucket (above 1: the extend kernel). Its
        hidden states are copied into the graphs' shared output (a few MB per pass, against a pool's
        worth per graph)."""
        buf = self._prefill_buffers
        meta = buf.metadata(
            num_tokens, buf.max_seqs, num_tokens, self.max_context_len, num_work=buf.max_work
        )
        ctx = ForwardContext(meta, self.kv.k, self.kv.v, self.backend)
        hidden = self.model(buf.dev64[0, :num_tokens], buf.dev64[1, :num_tokens], ctx)
        return self._graph_outputs[1][:num_tokens].copy_(hidden)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(src, dst)`` KV block, every layer, K and V, in one launch, before the next
        forward's writes (a step's copy-on-writes)."""
        self.kv.copy_blocks(copies)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` in the model dtype: the output projection only."""
        return self.model.compute_logits(hidden)

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def decode(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        carried: torch.Tensor | None = None,
        carried_rows: Sequence[int] | None = None,
        changed_tables: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One token per sequence; returns logits ``[num_seqs, vocab]`` in the model dtype.

        A sequence whose input token was sampled by the previous step and not yet read back takes it from
        ``carried`` (that step's device tensor of tokens) at row ``carried_rows[i]`` (-1: use ``input_ids[i]``;
        ``carried_rows`` None: row ``i`` for every sequence, the repeated batch's case, one copy),
        so the next step can be launched before the host has seen the last one's tokens. ``changed_tables``:
        of the tables the last decode had too, only these rows' may have been edited since (None: any; see
        `BlockTableRows`). Tables are the sequences' own lists: a sequence's list stands for it."""
        n = len(input_ids)
        if n > self.max_batch_size:
            raise ValueError(f"decode batch of {n} exceeds max_batch_size {self.max_batch_size}")
        bucket = next((b for b in self._graph_sizes if b >= n), n)
        buf = self._decode_buffers
        buf.ids[:n] = input_ids
        if carried_rows is not None:
            buf.carry_rows[:n] = carried_rows
        buf.positions[:n] = positions
        buf.slots[:n] = slots
        buf.slots[n:bucket] = -1  # padding rows store nothing ...
        buf.stage_rows(*self._decode_tables.update(tables, changed_tables))
        buf.context_lens[:n] = context_lens
        buf.context_lens[n:bucket] = 0  # ... and attend to nothing
        shared = (
            self._planner is not None
            and self._planner.plan(
                buf.tables, buf.context_lens[:n], buf.tile_seqs, buf.tile_lens, buf.kv_starts
            )
            > 0
        )
        buf.upload()
        if carried is not None:
            ids = buf.dev64[0, :n]
            if carried_rows is None:
                ids.copy_(carried)
            else:
                rows = buf.dev64[3, :n]
                ids.copy_(torch.where(rows >= 0, carried[rows.clamp(min=0)], ids))
        graph = self._graphs.get((bucket, shared))
        if graph is not None:
            graph[0].replay()
            return graph[1][:n]
        return self._decode_forward(n, int(np.max(context_lens)), shared)

    def _decode_forward(
        self, num_seqs: int, max_context_len: int, shared: bool, logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``shared``: attention reads the planned shared prefixes once per tile (grid: the most tiles a
        batch of ``num_seqs`` can have). ``logits``: ``[num_seqs, vocab]`` to write into (None:
        allocated)."""
        buf = self._decode_buffers
        num_tiles = self._planner.max_tiles(num_seqs) if shared else 0
        meta = buf.metadata(num_seqs, num_seqs, 1, max_context_len, num_tiles)
        ctx = ForwardContext(meta, self.kv.k, self.kv.v, self.backend)
        hidden = self.model(buf.dev64[0, :num_seqs], buf.dev64[1, :num_seqs], ctx)
        return self.model.compute_logits(hidden, out=logits)

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture the decode graphs per batch bucket, then the prefill graphs per token bucket, largest first,
        in one memory pool. Replays never overlap, so every graph writes its output into one shared
        tensor per kind (`_graph_outputs`; a logits tensor per decode bucket would be ~20 GB at
        batch 1,024 and a 152k vocabulary) and the pool holds one pass's temporaries. Decode: one
        plain graph and one reading shared prefixes once when the backend can (a step picks by
        whether the planner found any), with ``max_context_len`` as the context (it only sizes the
        decode kernel's split count). Captured on empty inputs: no slot stored, no context, every
        work item idle. The warm-up passes' cached blocks are returned to the device afterwards."""
        pool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:  # one per runner: cuBLAS keeps a workspace per stream
            self._capture_stream = torch.cuda.Stream(self.device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        dtype, dev = self.kv.k.dtype, self.device
        self._graph_outputs = (
            torch.empty((self.max_batch_size, self.model.vocab_size), dtype=dtype, device=dev),
            torch.empty((self._prefill_sizes[-1], self.model.hidden_size), dtype=dtype, device=dev),
        )

        def capture(forward, *args) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
            forward(*args)  # warm up: compile, autotune
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = forward(*args)
            return graph, out

        dec, pre = self._decode_buffers, self._prefill_buffers
        dec.slots[:] = pre.slots[:] = -1
        dec.context_lens[:] = pre.context_lens[:] = 0
        dec.tile_lens[:] = 0
        pre.work[1] = -1
        dec.upload()
        pre.upload()
        variants = (False, True) if self._planner is not None else (False,)
        sizes = sorted(graph_batch_sizes(self.max_batch_size), reverse=True)
        with torch.cuda.stream(stream):
            for size, shared in itertools.product(sizes, variants):
                logits = self._graph_outputs[0][:size]
                self._graphs[size, shared] = capture(
                    self._decode_forward, size, self.max_context_len, shared, logits
                )
            for num_tokens in reversed(self._prefill_sizes):
                self._prefill_graphs[num_tokens] = capture(self._prefill_graph_forward, num_tokens)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._graph_sizes = sorted(sizes)

    def _release_graphs(self) -> None:
        """Drop every graph and its outputs, and give their memory back to the device (steps run
        eagerly until the next capture)."""
        for graph, _ in itertools.chain(self._graphs.values(), self._prefill_graphs.values()):
            graph.reset()
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._graph_sizes = []
        self._graph_outputs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
