"""Turns a planned batch (token ids, positions, slots, block tables) into one forward of the model.

A forward's inputs are packed into persistent step buffers and sent in two copies
(`radixinfer/engine/step_buffers.py`); what the attention kernels read beyond the block tables (the
extend work list, decode's shared-prefix tiles) is planned by the attention backend's planner
(`AttentionPlanner`). On CUDA, decode steps and prefill passes replay CUDA graphs captured per
bucket (`radixinfer/engine/cuda_graphs.py`).

Prefill graphs are captured per token bucket for a fixed number of sequences: the pass is padded with
tokens that store nothing and belong to no sequence, and the extend kernel's grid is its work list's
capacity, so it does not depend on how the tokens split among the sequences. Decode steps whose
sequences share a cached prefix replay the graph variant that reads it once per tile of sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixinfer.attention import AttentionBackend, AttentionMetadata, ForwardContext
from radixinfer.engine.cuda_graphs import (
    StepGraphs,
    graph_batch_sizes,
    prefill_graph_token_counts,
)
from radixinfer.engine.decode_bytes import decode_kv_positions, decode_weight_bytes
from radixinfer.engine.kv_store import KVStore
from radixinfer.engine.memory import DeviceMemory, ProfiledMemory
from radixinfer.engine.sampler import Sampler
from radixinfer.engine.step_buffers import BlockTableRows, StepBuffers
from radixinfer.engine.worst_case import leave, sample_worst_case, worst_case_requests
from radixinfer.models.base import PagedCausalLM


class ModelRunner:
    """Owns the model, the KV tensors, the attention backend and the sampler (``sampler``: the
    engine samples through it, with token-count rows for ``max_batch_size`` penalised requests).

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
        self.sampler = Sampler(model.vocab_size, device, max_batch_size)
        dtype = next(model.parameters()).dtype
        m, bound = model, kv is not None
        if kv is None:  # a scratch store of one block
            kv = KVStore(
                m.num_layers, 1, self.block_size, m.num_kv_heads, m.head_dim, dtype, device
            )
        self.kv = kv
        self._planner = backend.planner(self.block_size, model.num_heads, model.num_kv_heads, dtype)
        max_tiles = self._planner.max_shared_prefix_tiles(max_batch_size)
        tiles = (max_tiles, self._planner.seqs_per_tile)
        self._decode_buffers = StepBuffers(
            max_batch_size, max_batch_size, self.table_width, device, *tiles
        )
        self._decode_buffers.query_start[:] = np.arange(max_batch_size + 1)  # one token per row
        self._decode_tables = BlockTableRows(self._decode_buffers.tables)
        self._prefill_sizes = prefill_graph_token_counts(prefill_max_tokens)
        self._prefill_buffers = self._prefill_step_buffers(
            self._prefill_sizes[-1], prefill_max_seqs, self.table_width
        )
        self.graphs = StepGraphs(device)
        self.weight_read_bytes = decode_weight_bytes(model)
        self.last_decode_read_bytes = 0  # the last decode step's floor in bytes (`decode_bytes`)
        if use_cuda_graphs is None:
            use_cuda_graphs = device.type == "cuda"
        self.use_cuda_graphs = use_cuda_graphs
        if bound and use_cuda_graphs:
            self._capture_graphs()

    def bind_kv(self, kv: KVStore) -> None:
        """Serve from ``kv`` (same block size) from now on; the graphs, which hold the old store's
        addresses, are captured again against it."""
        if kv.k.shape[2] != self.block_size:
            raise ValueError(
                f"the KV store's block size {kv.k.shape[2]} is not the runner's {self.block_size}"
            )
        self.graphs.release()
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
        some), and its peak allocation above what was allocated before it is the activation figure:
        it includes the sampler's token-count rows, which live between steps once a penalised
        request came. The graphs and the rows are released again before returning, and the
        allocator's cache emptied."""
        if self.device.type != "cuda":
            raise ValueError(f"profile_memory measures CUDA memory, not {self.device} memory")
        self.graphs.release()
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
        self.sampler.release()
        self.graphs.release()
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

        The sampler is the engine's own (``sampler``) in its most expensive mode
        (`radixinfer.engine.worst_case`): every filter, a bias, ``min_tokens`` and logprobs on
        every row, penalties on ``max_batch_size`` of them. Every token-count row stays allocated,
        free for the next requests."""
        seqs, n = self.prefill_max_seqs, self.max_batch_size
        tokens = min(max(self.prefill_max_tokens, seqs), seqs * self.max_context_len)
        query_lens = np.full(seqs, tokens // seqs, dtype=np.int64)
        query_lens[: tokens % seqs] += 1
        positions = np.concatenate([np.arange(q) for q in query_lens])
        tables = [[0] * -(-int(q) // self.block_size) for q in query_lens]
        ids = np.zeros(tokens, np.int64)
        reqs = worst_case_requests(max(seqs, n), n, self.max_context_len)
        hidden = self.prefill(ids, positions, [-1] * tokens, tables, query_lens, query_lens)
        last_rows = torch.as_tensor(np.cumsum(query_lens) - 1, device=self.device)
        sample_worst_case(self.sampler, reqs, self.logits(hidden[last_rows]))
        del hidden
        shared_len = 2 * self._planner.min_shared_len
        context_lens = np.full(n, min(self.max_context_len, shared_len), dtype=np.int64)
        context_lens[0] = self.max_context_len
        tables = [[0] * -(-int(c) // self.block_size) for c in context_lens]
        ids = np.zeros(n, np.int64)
        logits = self.decode(ids, context_lens - 1, [-1] * n, tables, context_lens)
        sample_worst_case(self.sampler, reqs, logits)
        leave(reqs)

    # ------------------------------------------------------------------ prefill
    def _prefill_step_buffers(self, max_tokens: int, max_seqs: int, width: int) -> StepBuffers:
        return StepBuffers(
            max_tokens,
            max_seqs,
            width,
            self.device,
            max_work=self._planner.extend_work_capacity(max_tokens, max_seqs),
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
        buf = self._prefill_buffers
        bucket = (
            next((t for t in self._prefill_sizes if t >= num_tokens), 0)
            if num_seqs <= buf.max_seqs
            else 0
        )
        if not bucket:  # larger than any planned pass: buffers of its own
            buf = self._prefill_step_buffers(num_tokens, num_seqs, max(map(len, tables)))
        query_lens = np.asarray(query_lens)
        buf.pack_prefill(input_ids, positions, slots, tables, context_lens, query_lens, bucket)
        num_work = self._planner.plan_extend_work(query_lens, buf.context_lens[:num_seqs], buf.work)
        buf.upload()
        hidden = self.graphs.replay_prefill(bucket, num_tokens)
        if hidden is not None:
            return hidden
        meta = buf.metadata(
            num_tokens, num_seqs, int(query_lens.max()), max(context_lens), num_work=num_work
        )
        return self._forward(buf, num_tokens, meta)

    def _prefill_graph_forward(self, num_tokens: int, out: torch.Tensor) -> torch.Tensor:
        """The forward a prefill graph of ``num_tokens`` captures: every sequence slot of the buffers, the whole
        work list (its grid), ``max_query_len`` at the bucket (above 1: the extend kernel). Its
        hidden states are copied into ``out``, the graphs' shared output (a few MB per pass, against
        a pool's worth per graph)."""
        buf = self._prefill_buffers
        meta = buf.metadata(
            num_tokens, buf.max_seqs, num_tokens, self.max_context_len, num_work=buf.max_work
        )
        return out.copy_(self._forward(buf, num_tokens, meta))

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
        bucket = next((b for b in self.graphs.decode_sizes if b >= n), n)
        buf = self._decode_buffers
        buf.pack_decode(input_ids, positions, slots, context_lens, carried_rows, bucket)
        buf.stage_rows(*self._decode_tables.update(tables, changed_tables))
        shared = (
            self._planner.plan_shared_prefixes(
                buf.tables, buf.context_lens[:n], buf.tile_seqs, buf.tile_lens, buf.kv_starts
            )
            > 0
        )
        buf.upload()
        tiles = (buf.kv_starts[:n], buf.tile_lens) if shared else ()
        self.last_decode_read_bytes = self.weight_read_bytes + self.kv.bytes_per_position * (
            decode_kv_positions(buf.context_lens[:n], *tiles)
        )
        if carried is not None:
            ids = buf.dev64[0, :n]
            if carried_rows is None:
                ids.copy_(carried)
            else:
                rows = buf.dev64[3, :n]
                ids.copy_(torch.where(rows >= 0, carried[rows.clamp(min=0)], ids))
        logits = self.graphs.replay_decode(bucket, shared, n)
        if logits is not None:
            return logits
        return self._decode_forward(n, int(np.max(context_lens)), shared)

    def _decode_forward(
        self, num_seqs: int, max_context_len: int, shared: bool, logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``shared``: attention reads the planned shared prefixes once per tile (grid: the most tiles a
        batch of ``num_seqs`` can have). ``logits``: ``[num_seqs, vocab]`` to write into (None:
        allocated)."""
        buf = self._decode_buffers
        num_tiles = self._planner.max_shared_prefix_tiles(num_seqs) if shared else 0
        meta = buf.metadata(
            num_seqs, num_seqs, 1, max_context_len, num_tiles, new_slots_private=True
        )
        return self.model.compute_logits(self._forward(buf, num_seqs, meta), out=logits)

    def _forward(self, buf: StepBuffers, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """The model over the first ``num_tokens`` ids and positions uploaded to ``buf``, attending
        through the KV pool with ``meta``: hidden states ``[num_tokens, hidden_size]``."""
        ctx = ForwardContext(meta, self.kv.k, self.kv.v, self.backend)
        return self.model(buf.dev64[0, :num_tokens], buf.dev64[1, :num_tokens], ctx)

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture the decode graphs per batch bucket, then the prefill graphs per token bucket
        (`StepGraphs.capture`). Decode: one plain graph and one reading shared prefixes once when the
        backend can (a step picks by whether the planner found any), with ``max_context_len`` as the
        context (it only sizes the decode kernel's split count). Captured on empty inputs: no slot
        stored, no context, every work item idle."""
        self._decode_buffers.make_idle()
        self._prefill_buffers.make_idle()
        self.graphs.capture(
            lambda n, shared, logits: self._decode_forward(n, self.max_context_len, shared, logits),
            graph_batch_sizes(self.max_batch_size),
            (False, True) if self._planner.seqs_per_tile else (False,),
            self._prefill_graph_forward,
            self._prefill_sizes,
            self.model.vocab_size,
            self.model.hidden_size,
            self.kv.k.dtype,
        )
