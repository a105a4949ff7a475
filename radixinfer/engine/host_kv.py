"""The host tier's tensors: a host pool of KV blocks and the copies that run the cache's queued
transfers (`KVCacheManager.take_transfers`) between it and the GPU's K and V tensors.

Layout. The GPU tensors are ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` each
(one block id indexes every layer), so one block is ``2 * num_layers`` separate pieces there. The
host pool is block-major, ``[num_host_blocks, 2, num_layers, block_size, num_kv_heads, head_dim]``:
a run of consecutive host blocks is one contiguous range, and one copy moves it across the bus. A
batch of blocks is gathered on the GPU into a staging tensor of the host layout (one
``index_select`` per K and V) and copied out one run at a time, or copied in one run at a time and
scattered (one ``index_copy_`` per K and V), never one copy per block per layer.

Streams. On CUDA the host pool is pinned and the copies run on a side stream: it waits for the work
queued before it (an offload reads what earlier forwards wrote, a load may write a block a finished
request held). The current stream waits for the offloads (the next forward may write the blocks
they free), not for the loads: the forwards of the step go on while loads run, and only requests
that read a loaded block wait, in the cache, until `finished_ticket` reports their take's loads
completed (an event on the side stream; the cache then lets them join). The host side returns as
soon as the copies are queued.

Load bandwidth: each load batch is timed on the side stream with CUDA events (wall time on a CPU)
and counted once complete: ``loaded_bytes`` over ``load_seconds``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from radixinfer.cache.host_tier import TransferBatch

# `HostKVPool.load_stats` without a host tier.
NO_LOADS = {"loaded_bytes": 0, "load_seconds": 0.0, "load_gb_per_s": 0.0}

# Staging tensors on the GPU hold at most this much (a long batch is moved in pieces).
MAX_STAGED_BYTES = 64 << 20


def host_blocks_for(host_cache_gb: float, bytes_per_block: int) -> int:
    """How many KV blocks of ``bytes_per_block`` fit in ``host_cache_gb`` GiB (``host_cache_gb``
    must be >= 0)."""
    return int(host_cache_gb * (1 << 30)) // bytes_per_block


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first id, length)`` of each run of consecutive ids in ``ids`` (ascending)."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            index, first, length = runs[-1]
            runs[-1] = (index, first, length + 1)
        else:
            runs.append((i, block, 1))
    return runs


class HostKVPool:
    """``num_blocks`` host KV blocks shaped like the blocks of ``k`` (and ``v``), and the copies
    between them and ``k`` / ``v`` (`run`). Pinned when ``k`` is on CUDA."""

    def __init__(self, num_blocks: int, k: torch.Tensor) -> None:
        if num_blocks < 1:
            raise ValueError(f"host_cache_gb holds no KV block (num_blocks {num_blocks})")
        num_layers, _, block_size, num_kv_heads, head_dim = k.shape
        self.device = k.device
        cuda = self.device.type == "cuda"
        # [num_blocks, K or V, num_layers, block_size, num_kv_heads, head_dim]
        self.blocks = torch.zeros(
            (num_blocks, 2, num_layers, block_size, num_kv_heads, head_dim),
            dtype=k.dtype,
            pin_memory=cuda,
        )
        self.block_bytes = self.blocks[0].numel() * self.blocks.element_size()
        self.max_staged_blocks = max(1, MAX_STAGED_BYTES // self.block_bytes)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        # Takes whose loads may be in flight, oldest first: (ticket, done event, load batch timings
        # as (start event, end event, bytes)).
        self._in_flight: deque[tuple[int, torch.cuda.Event, list]] = deque()
        self._finished = 0  # every take up to this ticket has its loads completed
        self.loaded_bytes = 0
        self.load_seconds = 0.0

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @torch.inference_mode()
    def run(
        self, batches: Sequence[TransferBatch], k: torch.Tensor, v: torch.Tensor, ticket: int
    ) -> None:
        """Run ``batches`` (take ``ticket`` of the cache) in order against the GPU tensors ``k`` and
        ``v``: on CUDA queued on the side stream, the current stream waiting for the offloads only
        (the module says why); on a CPU at once."""
        if self._stream is None:
            for batch in batches:
                begin = time.perf_counter()
                self._run(batch, k, v)
                if not batch.offload:
                    self.load_seconds += time.perf_counter() - begin
                    self.loaded_bytes += len(batch.src) * self.block_bytes
            self._finished = ticket
            return
        if not batches:
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        offloaded = None
        timings = []
        with torch.cuda.stream(self._stream):
            for batch in batches:
                if batch.offload:
                    self._run(batch, k, v)
                    offloaded = torch.cuda.Event()
                    offloaded.record()
                    continue
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                self._run(batch, k, v)
                end.record()
                timings.append((start, end, len(batch.src) * self.block_bytes))
            if timings:
                done = torch.cuda.Event()
                done.record()
                self._in_flight.append((ticket, done, timings))
        if offloaded is not None:
            current.wait_event(offloaded)

    def finished_ticket(self, wait: bool = False) -> int:
        """The latest take whose loads, and every earlier take's, have completed (``wait``: wait
        for every load in flight first); counts the completed loads' bytes and time."""
        in_flight = self._in_flight
        while in_flight and (wait or in_flight[0][1].query()):
            ticket, done, timings = in_flight.popleft()
            done.synchronize()
            for start, end, nbytes in timings:
                self.load_seconds += start.elapsed_time(end) / 1e3
                self.loaded_bytes += nbytes
            self._finished = ticket
        return self._finished

    def load_stats(self) -> dict[str, float]:
        """The completed loads (those completed since the last step counted first): bytes, device
        seconds and their ratio (`NO_LOADS`' keys)."""
        self.finished_ticket()
        seconds = self.load_seconds
        rate = self.loaded_bytes / seconds / 1e9 if seconds else 0.0
        return {"loaded_bytes": self.loaded_bytes, "load_seconds": seconds, "load_gb_per_s": rate}

    def _run(self, batch: TransferBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        gpu_ids, host_ids = (batch.src, batch.dst) if batch.offload else (batch.dst, batch.src)
        pairs = sorted(zip(host_ids, gpu_ids))  # host ids ascending: the longest runs
        step = self.max_staged_blocks
        for start in range(0, len(pairs), step):
            host_part, gpu_part = zip(*pairs[start : start + step])
            gpu_index = torch.tensor(gpu_part, dtype=torch.int64).to(self.device, non_blocking=True)
            if batch.offload:
                self._offload(gpu_index, host_part, k, v)
            else:
                self._load(host_part, gpu_index, k, v)

    def _offload(
        self, gpu_index: torch.Tensor, host_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        # [n, 2, num_layers, block_size, num_kv_heads, head_dim]
        pair = (k.index_select(1, gpu_index), v.index_select(1, gpu_index))
        staged = torch.stack(pair, dim=1).transpose(0, 2).contiguous()
        for index, first, length in _runs(host_ids):
            self.blocks[first : first + length].copy_(
                staged[index : index + length], non_blocking=True
            )

    def _load(
        self, host_ids: Sequence[int], gpu_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        staged = torch.empty(
            (len(host_ids), *self.blocks.shape[1:]), dtype=k.dtype, device=self.device
        )
        for index, first, length in _runs(host_ids):
            staged[index : index + length].copy_(
                self.blocks[first : first + length], non_blocking=True
            )
        k.index_copy_(1, gpu_index, staged[:, 0].transpose(0, 1))
        v.index_copy_(1, gpu_index, staged[:, 1].transpose(0, 1))
