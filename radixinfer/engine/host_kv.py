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
queued before it (an offload reads what earlier forwards wrote), and the current stream waits for it
(the next forward reads loaded blocks and overwrites offloaded ones), so a forward never overlaps a
copy of a block it touches. The host side returns as soon as the copies are queued.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixinfer.cache.host_tier import TransferBatch

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
        block_bytes = self.blocks[0].numel() * self.blocks.element_size()
        self.max_staged_blocks = max(1, MAX_STAGED_BYTES // block_bytes)
        self._stream = torch.cuda.Stream(self.device) if cuda else None

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @torch.inference_mode()
    def run(self, batches: Sequence[TransferBatch], k: torch.Tensor, v: torch.Tensor) -> None:
        """Run ``batches`` in order against the GPU tensors ``k`` and ``v`` (on CUDA: queued on the
        side stream, ordered against the current stream as the module says)."""
        if not batches:
            return
        if self._stream is None:
            for batch in batches:
                self._run(batch, k, v)
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for batch in batches:
                self._run(batch, k, v)
        current.wait_stream(self._stream)

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
