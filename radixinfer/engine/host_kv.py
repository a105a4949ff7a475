"""The host tier's tensors: a host pool of KV blocks and the copies that run the cache's queued
transfers (`KVCacheManager.take_transfers`) between it and the GPU's K and V tensors.

Layout. The GPU tensors are ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` each
(one block id indexes every layer), so one block is ``2 * num_layers`` separate pieces there. The
host pool is block-major, ``[num_host_blocks, 2, num_layers, block_size, num_kv_heads, head_dim]``:
a run of consecutive host blocks is one contiguous range, and one copy moves it across the bus. It
is held in a few *segments* of consecutive blocks (`segment_blocks`): torch's pinned-memory
allocator rounds every allocation up to a power of two of bytes, so one 72 GiB tensor would pin
128 GiB; each segment fills its power of two but for less than a block, and a run that crosses
from one segment into the next is copied in two pieces. A
batch of blocks is gathered on the GPU into a staging tensor of the host layout (one
``index_select`` per K and V) and copied out one run at a time, or copied in one run at a time and
scattered (one ``index_copy_`` per K and V), never one copy per block per layer.

Streams. On CUDA the host pool is pinned. An offload's gather into its staging tensor runs on the
current stream, in order with the forwards: the blocks it frees may be written by the very next
forward, which then needs no wait. Its copy across the bus, and every load, run on a side stream
that waits for the work queued before it (a load may write a block a gather just read, or one a
finished request held). The current stream waits there for nothing but:

- the copies out of the one write-back staging tensor before it gathers into it again. The staging
  holds as many blocks as one engine step can evict (`write_back_blocks`; the memory plan reserves
  it), so a step's write-backs gather at once and their copies drain over the bus while the next
  forwards run. A 64 MiB staging area held each llama-3.1-8b prefill round's forward behind
  the bus copies of the round's evictions (1 GiB, ~22 ms at 48 GB/s): with nothing reused, the
  tier cost 5% of the throughput, against 1.2% now;
- the loads, when the engine has nothing else to run (`join`, below).

So the step's forwards run while the bus copies do. Only the requests that read a loaded block
wait, in the cache, until `finished_ticket` reports their take's loads completed (an event on the
side stream; the cache then lets them join a later pass), or until the engine, with nothing else to
run, has the current stream wait for the loads (`join`); an offload that reads a block still
loading (`TransferBatch.reads_loading`) has the current stream wait for the side stream first. The
host side returns as soon as the copies are queued; index tensors go up from pinned memory, so
nothing here waits for the device.

Load bandwidth: each load batch is timed on the side stream with CUDA events (wall time on a CPU)
and counted once complete: ``loaded_bytes`` over ``load_seconds``.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from radixinfer.cache.host_tier import TransferBatch
from radixinfer.engine.pipeline import device_index

# `HostKVPool.load_stats` without a host tier.
NO_LOADS = {"loaded_bytes": 0, "load_seconds": 0.0, "load_gb_per_s": 0.0}

# A load is staged on the GPU this much at a time (a long batch is moved in pieces).
LOAD_STAGED_BYTES = 64 << 20


def host_blocks_for(host_cache_gb: float, bytes_per_block: int) -> int:
    """How many KV blocks of ``bytes_per_block`` fit in ``host_cache_gb`` GiB (``host_cache_gb``
    must be >= 0)."""
    return int(host_cache_gb * (1 << 30)) // bytes_per_block


def write_back_blocks(
    host_blocks: int,
    block_size: int,
    round_tokens: int,
    round_requests: int,
    max_batch_size: int,
) -> int:
    """How many blocks the write-back staging holds: as many as one engine step can evict, so that
    a step's write-backs gather at once, their copies draining while the next forwards run. A step
    allocates at most a prefill round's ``round_tokens`` positions in blocks, a block more for each
    of its ``round_requests`` (a partial one), and a block for each of ``max_batch_size`` decoding
    sequences; no more than the host pool's ``host_blocks`` (a step that evicts more still runs,
    its gathers waiting for the bus)."""
    per_step = -(-round_tokens // block_size) + round_requests + max_batch_size
    return max(1, min(host_blocks, per_step))


def segment_blocks(num_blocks: int, block_bytes: int) -> list[int]:
    """How many blocks each segment of a host pool of ``num_blocks`` blocks of ``block_bytes``
    holds, largest first: as many as fit the largest power of two of bytes not above what is left
    (at least one), so that the pinned allocator's rounding up to a power of two adds less than a
    block to each, and there are at most about ``log2(num_blocks)`` of them."""
    sizes, left = [], num_blocks
    while left:
        power = 1 << ((left * block_bytes).bit_length() - 1)
        count = max(1, min(left, power // block_bytes))
        sizes.append(count)
        left -= count
    return sizes


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(index, first id, length)`` of each run of consecutive ids in ``ids`` (ascending)."""
    starts = np.flatnonzero(np.diff(ids, prepend=ids[0] - 2) != 1)
    lengths = np.diff(starts, append=len(ids))
    return list(zip(starts.tolist(), ids[starts].tolist(), lengths.tolist()))


class HostKVPool:
    """``num_blocks`` host KV blocks shaped like the blocks of ``k`` (and ``v``), in `segments`, and
    the copies between them and ``k`` / ``v`` (`run`). Pinned when ``k`` is on CUDA. The
    write-back staging holds ``staged_blocks`` blocks on ``k``'s device (`write_back_blocks`),
    allocated here so that the memory plan's reservation is what it takes."""

    def __init__(self, num_blocks: int, k: torch.Tensor, staged_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"host_cache_gb holds no KV block (num_blocks {num_blocks})")
        if not 1 <= staged_blocks <= num_blocks:  # `write_back_blocks` sizes it so
            raise ValueError(f"staged_blocks must be in [1, {num_blocks}], got {staged_blocks}")
        num_layers, _, block_size, num_kv_heads, head_dim = k.shape
        self.device = k.device
        cuda = self.device.type == "cuda"
        self.block_shape = (2, num_layers, block_size, num_kv_heads, head_dim)
        self.block_bytes = math.prod(self.block_shape) * k.element_size()
        # each [its blocks, K or V, num_layers, block_size, num_kv_heads, head_dim]
        self.segments = [
            torch.zeros((count, *self.block_shape), dtype=k.dtype, pin_memory=cuda)
            for count in segment_blocks(num_blocks, self.block_bytes)
        ]
        # the first block of each segment, and the end of the last
        self._segment_starts = np.cumsum([0] + [len(s) for s in self.segments]).tolist()
        self.load_staged_blocks = min(num_blocks, max(1, LOAD_STAGED_BYTES // self.block_bytes))
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        # Takes whose loads may be in flight, oldest first: (ticket, done event, load batch timings
        # as (start event, end event, bytes)).
        self._in_flight: deque[tuple[int, torch.cuda.Event, list]] = deque()
        self._finished = 0  # every take up to this ticket has its loads completed
        self.loaded_bytes = 0
        self.load_seconds = 0.0
        # The write-backs' staging tensor and, on CUDA, the event after the last copies out of it.
        self._out = self._staging(staged_blocks, k)
        self._out_copied: torch.cuda.Event | None = None

    @property
    def num_blocks(self) -> int:
        return self._segment_starts[-1]

    def _pieces(self, host_ids: np.ndarray) -> Iterator[tuple[slice, torch.Tensor]]:
        """What one copy each moves of the host blocks ``host_ids`` (ascending): ``(rows of the
        staging tensor, a view of a segment)`` per run of consecutive ids, a run that crosses into
        the next segment in two pieces."""
        starts = self._segment_starts
        for index, first, length in _runs(host_ids):
            segment = bisect.bisect_right(starts, first) - 1
            offset = 0
            while offset < length:
                begin = first + offset - starts[segment]
                piece = self.segments[segment][begin : begin + length - offset]
                yield slice(index + offset, index + offset + len(piece)), piece
                offset += len(piece)
                segment += 1

    @torch.inference_mode()
    def run(
        self, batches: Sequence[TransferBatch], k: torch.Tensor, v: torch.Tensor, ticket: int
    ) -> None:
        """Run ``batches`` (take ``ticket`` of the cache) in order against the GPU tensors ``k`` and
        ``v``: on CUDA queued, the offloads' gathers on the current stream and every copy across
        the bus on the side stream, which the current stream does not wait for (the module says
        why); on a CPU at once."""
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
        current, side = torch.cuda.current_stream(self.device), self._stream
        timings = []
        for batch in batches:
            if batch.offload:
                if batch.reads_loading:
                    current.wait_stream(side)
                self._run(batch, k, v)  # its gathers on the current stream, its copies on the side
                continue
            side.wait_stream(current)
            with torch.cuda.stream(side):
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
            done.record(side)
            self._in_flight.append((ticket, done, timings))

    def join(self) -> None:
        """Make the current stream wait for every copy queued so far (the host does not wait): what
        is queued on it next reads the loaded blocks."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

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
        host = np.array(host_ids, dtype=np.int64)
        order = np.argsort(host, kind="stable")  # host ids ascending: the longest runs
        host, gpu = host[order], np.array(gpu_ids, dtype=np.int64)[order]
        step = len(self._out) if batch.offload else self.load_staged_blocks
        for start in range(0, len(host), step):
            host_part = host[start : start + step]
            gpu_index = device_index(gpu[start : start + step].tolist(), self.device)
            if batch.offload:
                self._offload(gpu_index, host_part, k, v)
            else:
                self._load(host_part, gpu_index, k, v)

    def _staging(self, count: int, k: torch.Tensor) -> torch.Tensor:
        """A staging tensor of ``count`` blocks in the host layout, on the device."""
        return torch.empty((count, *self.block_shape), dtype=k.dtype, device=self.device)

    def _offload(
        self, gpu_index: torch.Tensor, host_ids: np.ndarray, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Gather the blocks into the write-back staging tensor on the current stream, then copy
        them out on the side stream (on a CPU, at once). One staging tensor serves every
        write-back: a gather waits for the copies out of the one before (long done, unless a step
        evicts more than the staging holds)."""
        side = self._stream
        current = None if side is None else torch.cuda.current_stream(self.device)
        if current is not None and self._out_copied is not None:
            current.wait_event(self._out_copied)
        staged = self._out[: len(host_ids)]  # [n, 2, num_layers, block_size, heads, dim]
        staged[:, 0].copy_(k.index_select(1, gpu_index).transpose(0, 1))
        staged[:, 1].copy_(v.index_select(1, gpu_index).transpose(0, 1))
        if side is not None:
            side.wait_stream(current)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for rows, host in self._pieces(host_ids):
                host.copy_(staged[rows], non_blocking=True)
            if side is not None:
                self._out_copied = torch.cuda.Event()
                self._out_copied.record()

    def _load(
        self, host_ids: np.ndarray, gpu_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        staged = self._staging(len(host_ids), k)
        for rows, host in self._pieces(host_ids):
            staged[rows].copy_(host, non_blocking=True)
        k.index_copy_(1, gpu_index, staged[:, 0].transpose(0, 1))
        v.index_copy_(1, gpu_index, staged[:, 1].transpose(0, 1))
