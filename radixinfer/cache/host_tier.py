"""The host-memory tier's bookkeeping: a pool of host KV blocks under the GPU pool, and the queue of
block copies between the two pools.

The radix tree moves a node between tiers (`RadixTree.evict` writes an evicted tail back to host
blocks, `RadixTree.load` brings a host-resident node back) and queues the copies here; nothing is
copied yet. The engine takes the queue (`HostTier.take_transfers`) and runs it, in order, before its
next block copy or forward (`radixinfer.engine.host_kv`). Torch-free: block ids only.

Ordering. A queued copy reads its source when it runs, not when it was queued, so the queue is run
before anything else writes a block: a GPU block freed by an offload may be handed out at once, but
the next write into it (a load, a copy-on-write, a forward) runs after the offload read it. Copies
of one direction in a row form one batch; within a batch only two copies into one destination can
conflict (the first went to a block freed and handed out again since), and the later one wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixinfer.cache.block_pool import BlockPool


@dataclass(frozen=True)
class TransferBatch:
    """Block copies of one direction: ``src[i] -> dst[i]``, every layer, K and V. ``offload``: GPU
    blocks to host blocks; otherwise host blocks to GPU blocks (a load). Destinations are
    distinct."""

    offload: bool
    src: list[int]
    dst: list[int]


@dataclass
class HostCounters:
    """Monotonic counters of the host tier (they survive `reset`)."""

    offloaded_blocks: int = 0
    offloaded_tokens: int = 0  # positions of nodes written back to the host
    loaded_blocks: int = 0
    loaded_tokens: int = 0  # positions of nodes loaded back to the GPU
    host_evicted_blocks: int = 0  # host blocks freed by the host tier's own eviction


@dataclass
class HostTier:
    """``num_blocks`` host blocks (a `BlockPool`: a host-resident node holds one reference per block
    it lists, as on the GPU) and the copies queued since the engine last took them."""

    num_blocks: int
    block_size: int
    pool: BlockPool = field(init=False)
    counters: HostCounters = field(init=False, default_factory=HostCounters)
    _queue: list[tuple[bool, int, int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.block_size)

    def queue(self, offload: bool, src: list[int], dst: list[int]) -> None:
        """Queue ``src[i] -> dst[i]`` (``offload``: GPU to host, else host to GPU)."""
        self._queue.extend((offload, s, d) for s, d in zip(src, dst))

    def take_transfers(self) -> list[TransferBatch]:
        """Every queued copy, in queue order, as batches of one direction (the caller runs them in
        this order before its next block copy or forward); the queue is left empty."""
        batches: list[TransferBatch] = []
        run: dict[int, int] = {}  # dst -> src of the current batch; a later copy to a dst wins
        direction = None
        for offload, src, dst in self._queue:
            if offload is not direction and run:
                batches.append(TransferBatch(direction, list(run.values()), list(run)))
                run = {}
            direction = offload
            run.pop(dst, None)  # keep the batch in queue order of the surviving copies
            run[dst] = src
        if run:
            batches.append(TransferBatch(direction, list(run.values()), list(run)))
        self._queue.clear()
        return batches

    def reset(self) -> None:
        """Forget the queued copies (after every block of both pools was freed, none is read)."""
        self._queue.clear()
