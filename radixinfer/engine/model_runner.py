"""Turns a planned batch (token ids, positions, slots, block tables) into one forward of the model.

Host data goes to the device in two copies per forward (one int64 buffer: token ids, positions, slots;
one int32 buffer: context lengths, query starts, block tables), never one small copy per field or request.
On CUDA, decode steps replay CUDA graphs captured per batch-size bucket: a small model's decode step is
hundreds of kernel launches, and launching them from Python costs far more than running them.

Decode keeps its buffers across steps: the block-table rows are rewritten only where a table changed
(`BlockTableRows`), and only the rows of the batch travel to the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from radixinfer.attention import AttentionBackend, AttentionMetadata, ForwardContext
from radixinfer.cache.kv_store import KVStore
from radixinfer.models.base import PagedCausalLM


def pack_block_tables(tables: Sequence[Sequence[int]], out: np.ndarray) -> None:
    """Write ragged block tables into the rows of ``out`` ``[>= len(tables), width]`` (vectorised: one
    boolean-mask assignment, row-major, so the concatenation lands row by row). Padding entries are 0."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=out.dtype, count=int(lens.sum()))
    rows = out[: len(tables)]
    rows[...] = 0
    rows[np.arange(out.shape[1])[None, :] < lens[:, None]] = flat


class BlockTableRows:
    """Block tables packed into the rows of a persistent host array ``[num_rows, width]`` (zeros past each
    table's end), rewritten only where they changed.

    A decode step grows about one table in ``block_size`` by a block and leaves the rest as they were, while
    converting every entry of every table from Python ints costs ~25 ns each (~0.3 ms at 256 x 50 blocks).
    `update` compares each row's table with a copy of what it last wrote there (a list comparison, in C,
    mostly pointer-equal ints), so any change is caught: growth, a copy-on-write of the last block, a remap,
    another sequence moving into the row. Tables must be lists (what the cache hands out). Rows past the batch
    keep what they held.
    """

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows  # [num_rows, width] int32, zero-filled by the caller
        self._written: list[list[int]] = [[] for _ in range(rows.shape[0])]  # row -> the table it holds

    def update(self, tables: Sequence[list[int]]) -> int:
        """Make rows ``0 .. len(tables) - 1`` hold ``tables``. Returns how many rows were rewritten."""
        rows, written = self.rows, self._written
        rewritten = 0
        for i, table in enumerate(tables):
            old = written[i]
            if old != table:
                n = len(table)
                rows[i, :n] = table
                if len(old) > n:
                    rows[i, n : len(old)] = 0
                written[i] = table.copy()
                rewritten += 1
        return rewritten


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Buckets a decode batch is padded up to: fine-grained where small batches are common."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


class _StepBuffers:
    """Host (pinned on CUDA) and device buffers for up to ``max_tokens`` tokens / ``max_seqs`` sequences.
    The device tensors double as a CUDA graph's static inputs.

    The int32 buffer is laid out ``[context_lens (max_seqs) | query_start (max_seqs + 1) | tables (max_seqs x
    width)]``, so the part a batch of ``n`` sequences uses is one prefix of it (`upload` copies only that)."""

    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        # ids, positions, slots, and (decode) the row of each sequence's input in the previous step's tokens
        self.host64 = torch.zeros(4, max_tokens, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(2 * max_seqs + 1 + max_seqs * width, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.width, self.max_seqs = width, max_seqs
        self._tables_at = 2 * max_seqs + 1  # offset of the tables in the int32 buffers
        h64, h32 = self.host64.numpy(), self.host32.numpy()
        self.ids, self.positions, self.slots, self.carry_rows = h64[0], h64[1], h64[2], h64[3]
        self.context_lens = h32[:max_seqs]
        self.query_start = h32[max_seqs : self._tables_at]
        self.tables = h32[self._tables_at :].reshape(max_seqs, width)

    def upload(self, num_seqs: int) -> None:
        """Copy the host buffers to the device, block-table rows of the first ``num_seqs`` sequences only
        (the rest on the device keep stale rows, which nothing reads: their context length is 0)."""
        self.dev64.copy_(self.host64, non_blocking=True)
        end = self._tables_at + num_seqs * self.width
        self.dev32[:end].copy_(self.host32[:end], non_blocking=True)

    def metadata(self, num_tokens: int, num_seqs: int, max_query_len: int, max_context_len: int) -> AttentionMetadata:
        at, n = self._tables_at, self.max_seqs
        return AttentionMetadata(
            slot_mapping=self.dev64[2, :num_tokens],
            block_tables=self.dev32[at:].view(n, self.width)[:num_seqs],
            context_lens=self.dev32[:num_seqs],
            query_start_loc=self.dev32[n : n + num_seqs + 1],
            max_query_len=max_query_len,
            max_context_len=max_context_len,
        )


class ModelRunner:
    """Owns the model, the KV tensors and the attention backend."""

    def __init__(
        self,
        model: PagedCausalLM,
        kv: KVStore,
        backend: AttentionBackend,
        device: torch.device,
        max_batch_size: int,
        use_cuda_graphs: bool | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = device
        self.block_size = kv.k.shape[2]
        self.table_width = -(-model.max_context_len // self.block_size)
        self.max_batch_size = max_batch_size
        self._decode_buffers = _StepBuffers(max_batch_size, max_batch_size, self.table_width, device)
        self._decode_buffers.query_start[:] = np.arange(max_batch_size + 1)  # one token per sequence
        self._decode_tables = BlockTableRows(self._decode_buffers.tables)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if use_cuda_graphs is None:
            use_cuda_graphs = device.type == "cuda"
        if use_cuda_graphs:
            self._capture_decode_graphs()

    # ------------------------------------------------------------------ prefill
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
        Returns the final hidden states ``[num_tokens, hidden_size]``."""
        num_tokens, num_seqs = len(input_ids), len(tables)
        width = max(map(len, tables))
        buf = _StepBuffers(num_tokens, num_seqs, width, self.device)
        buf.ids[:] = input_ids
        buf.positions[:] = positions
        buf.slots[:] = slots
        pack_block_tables(tables, buf.tables)
        buf.context_lens[:] = context_lens
        buf.query_start[0] = 0
        np.cumsum(query_lens, out=buf.query_start[1:])
        buf.upload(num_seqs)
        meta = buf.metadata(num_tokens, num_seqs, max(query_lens), max(context_lens))
        return self.model(buf.dev64[0], buf.dev64[1], ForwardContext(meta, self.kv.k, self.kv.v, self.backend))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32: the output projection only."""
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
    ) -> torch.Tensor:
        """One token per sequence; returns logits ``[num_seqs, vocab]`` float32.

        A sequence whose input token was sampled by the previous step and not yet read back takes it from
        ``carried`` (that step's device tensor of tokens) at row ``carried_rows[i]`` (-1: use ``input_ids[i]``),
        so the next step can be launched before the host has seen the last one's tokens."""
        n = len(input_ids)
        if n > self.max_batch_size:
            raise ValueError(f"decode batch of {n} exceeds max_batch_size {self.max_batch_size}")
        bucket = next((b for b in self._graphs if b >= n), n)
        buf = self._decode_buffers
        buf.ids[:n] = input_ids
        if carried is not None:
            buf.carry_rows[:n] = carried_rows
        buf.positions[:n] = positions
        buf.slots[:n] = slots
        buf.slots[n:bucket] = -1  # padding rows store nothing ...
        self._decode_tables.update(tables)
        buf.context_lens[:n] = context_lens
        buf.context_lens[n:bucket] = 0  # ... and attend to nothing
        buf.upload(n)
        if carried is not None:
            ids, rows = buf.dev64[0, :n], buf.dev64[3, :n]
            ids.copy_(torch.where(rows >= 0, carried[rows.clamp(min=0)], ids))
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph[0].replay()
            return graph[1][:n]
        return self._decode_forward(n, max(context_lens))

    def _decode_forward(self, num_seqs: int, max_context_len: int) -> torch.Tensor:
        buf = self._decode_buffers
        meta = buf.metadata(num_seqs, num_seqs, 1, max_context_len)
        ctx = ForwardContext(meta, self.kv.k, self.kv.v, self.backend)
        hidden = self.model(buf.dev64[0, :num_seqs], buf.dev64[1, :num_seqs], ctx)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_decode_graphs(self) -> None:
        """Capture one graph per batch bucket, largest first, sharing one memory pool. Captured with the
        model's whole context as ``max_context_len`` (it only sizes the decode kernel's split count)."""
        buf = self._decode_buffers
        buf.slots[:] = -1
        buf.context_lens[:] = 0
        buf.upload(self.max_batch_size)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graphs = {}
        with torch.cuda.stream(stream):
            for size in sorted(graph_batch_sizes(self.max_batch_size), reverse=True):
                self._decode_forward(size, self.model.max_context_len)  # warm up: compile, autotune
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._decode_forward(size, self.model.max_context_len)
                graphs[size] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self._graphs = dict(sorted(graphs.items()))
