"""The host-memory tier's bookkeeping: a pool of host KV blocks under the GPU pool, and the queue of
block copies between the two pools.

The radix tree moves a node between tiers (`RadixTree.evict` writes an evicted tail back to host
blocks, `RadixTree.load` brings a host-resident node back) and queues the copies here; nothing is
copied yet. The engine takes the queue (`HostTier.take_transfers`) and runs it, in order, before its
next block copy or forward (`radixinfer.engine.host_kv`). Torch-free: block ids only.

Loads in flight. The loads of one take are one *ticket* (`take_transfers` numbers them 1, 2, ...):
their GPU blocks are *loading* from the moment they are queued until the engine reports the ticket
done (`finish_loads`, once the copies completed on the device), and no reader may use them before
(`is_loading`): the engine does not wait for loads before its next forward, only the requests that
read loaded blocks wait.

Ordering. A queued copy reads its source when it runs, not when it was queued, so the queue is run
before anything else writes a block: a GPU block freed by an offload may be handed out at once, but
the next write into it (a load, a copy-on-write, a forward) runs after the offload read it. Copies
of one direction in a row form one batch; within a batch only two copies into one destination can
conflict (the first went to a block freed and handed out again since), and the later one wins.
"""

from __future__ import annotations

from collections.abc import Iterable
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
    # write-through: positions copied to the host while still on the GPU (`HostResidency`), and
    # positions whose eviction took such a copy instead of a copy of its own
    written_through_blocks: int = 0
    written_through_tokens: int = 0
    evicted_to_copy_tokens: int = 0


@dataclass
class HostTier:
    """``num_blocks`` host blocks (a `BlockPool`: a host-resident node holds one reference per block
    it lists, as on the GPU) and the copies queued since the engine last took them."""

    num_blocks: int
    block_size: int
    pool: BlockPool = field(init=False)
    counters: HostCounters = field(init=False, default_factory=HostCounters)
    _queue: list[tuple[bool, int, int]] = field(init=False, default_factory=list)
    tickets_taken: int = field(init=False, default=0)  # the ticket of the last take
    _loading: dict[int, int] = field(init=False, default_factory=dict)  # GPU block -> ticket

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.block_size)

    def queue(self, offload: bool, src: list[int], dst: list[int]) -> None:
        """Queue ``src[i] -> dst[i]`` (``offload``: GPU to host, else host to GPU). A load's GPU
        blocks are loading from now on, under the ticket of the next take."""
        self._queue.extend((offload, s, d) for s, d in zip(src, dst))
        if not offload:
            ticket = self.tickets_taken + 1
            for block in dst:
                self._loading[block] = ticket

    def take_transfers(self) -> list[TransferBatch]:
        """Every queued copy, in queue order, as batches of one direction (the caller runs them in
        this order before its next block copy or forward); the queue is left empty. The take is
        ticket `tickets_taken` (its loads' destinations are loading until `finish_loads` of it)."""
        self.tickets_taken += 1
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

    def finish_loads(self, ticket: int) -> None:
        """The loads of ``ticket`` and of every earlier one have completed on the device."""
        if self._loading:
            self._loading = {b: t for b, t in self._loading.items() if t > ticket}

    def is_loading(self, blocks: Iterable[int]) -> bool:
        """Whether a load into any of the GPU ``blocks`` may still be in flight."""
        loading = self._loading
        return bool(loading) and any(b in loading for b in blocks)

    def reset(self) -> None:
        """Forget the queued copies (after every block of both pools was freed, none is read); the
        caller has waited for every load."""
        self._queue.clear()
        self._loading.clear()
