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
the next write into it (a load, a copy-on-write, a forward) runs after the offload read it. The
take groups the copies into batches of one direction; a copy may run before an earlier one of the
other direction only when they share no block (`take_transfers`), and within a batch only two
copies into one destination can conflict (the first went to a block freed and handed out again
since), and the later one wins.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from radixinfer.cache.block_pool import BlockPool, QueuedBlockPool


@dataclass(frozen=True)
class TransferBatch:
    """Block copies of one direction: ``src[i] -> dst[i]``, every layer, K and V. ``offload``: GPU
    blocks to host blocks; otherwise host blocks to GPU blocks (a load). Destinations are
    distinct. ``reads_loading``: an offload reading a GPU block that a load may still be writing
    (of this take, or of an earlier one not reported complete): it must wait for the loads."""

    offload: bool
    src: list[int]
    dst: list[int]
    reads_loading: bool = False


@dataclass
class HostCounters:
    """Monotonic counters of the host tier (they survive `reset`)."""

    offloaded_blocks: int = 0
    offloaded_tokens: int = 0  # positions of nodes written back to the host
    loaded_blocks: int = 0
    # positions of nodes loaded back to the GPU, each for a request admitted in that step (its
    # reservation was made room for first): `EngineCounters.host_hit_tokens` but for what it lists
    loaded_tokens: int = 0
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
    # the queued copies, as the calls queued them: (offload, src, dst)
    _queue: list[tuple[bool, list[int], list[int]]] = field(init=False, default_factory=list)
    tickets_taken: int = field(init=False, default=0)  # the ticket of the last take
    _loading: dict[int, int] = field(init=False, default_factory=dict)  # GPU block -> ticket

    def __post_init__(self) -> None:
        self.pool = QueuedBlockPool(self.num_blocks, self.block_size)

    def queue(self, offload: bool, src: list[int], dst: list[int]) -> None:
        """Queue ``src[i] -> dst[i]`` (``offload``: GPU to host, else host to GPU). A load's GPU
        blocks are loading from now on, under the ticket of the next take."""
        self._queue.append((offload, list(src), list(dst)))  # the callers' lists change later
        if not offload:
            ticket = self.tickets_taken + 1
            for block in dst:
                self._loading[block] = ticket

    def take_transfers(self) -> list[TransferBatch]:
        """Every queued copy as batches of one direction, to be run in the order given (before the
        caller's next block copy or forward); the queue is left empty. The take is ticket
        `tickets_taken` (its loads' destinations are loading until `finish_loads` of it).

        Each copy goes into the first batch of its direction that comes after every earlier copy
        of the other direction sharing a block with it (a GPU block, or a host block), and not
        before an earlier copy into its own destination; the batches alternate in direction,
        offloads first. Copies that share no block thus form one batch per direction, however
        the queue interleaves them (an admission that loads several nodes queues a write-back,
        then a load, per node). Within a batch, a later copy into a destination replaces the
        earlier one (the first went to a block freed and handed out again since).

        A queue of write-backs alone (every step of a workload that evicts and reuses nothing) is
        one batch, built without a step per copy in Python."""
        self.tickets_taken += 1
        if all(offload for offload, _, _ in self._queue):  # an entry per call, not per copy
            if not self._queue:
                return []
            run: dict[int, int] = {}  # dst -> src: a later copy into a dst replaces the earlier
            for _, src, dst in self._queue:
                run.update(zip(dst, src))
            self._queue.clear()
            src = list(run.values())
            return [TransferBatch(True, src, list(run), self.is_loading(src))]
        levels: list[dict[int, int]] = []  # batch index -> {dst: src}, in queue order
        # (direction, pool, block) -> the latest batch of that direction touching the block,
        # and (direction, block) -> the latest batch of that direction writing the block
        touched: dict[tuple[bool, bool, int], int] = {}
        written: dict[tuple[bool, int], int] = {}
        copies = ((o, s, d) for o, src, dst in self._queue for s, d in zip(src, dst))
        for offload, src, dst in copies:
            # offloads read GPU blocks and write host blocks, loads the reverse (pool: is host)
            blocks = ((not offload, src), (offload, dst))
            after = written.get((offload, dst), 0)
            for pool, block in blocks:
                after = max(after, touched.get((not offload, pool, block), -1) + 1)
            level = after if (after % 2 == 0) == offload else after + 1
            while len(levels) <= level:
                levels.append({})
            run = levels[level]
            run.pop(dst, None)  # keep the batch in queue order of the surviving copies
            run[dst] = src
            for pool, block in blocks:
                if touched.get((offload, pool, block), -1) < level:
                    touched[(offload, pool, block)] = level
            written[(offload, dst)] = level
        self._queue.clear()
        loading = self._loading
        batches = []
        for index, run in enumerate(levels):
            if run:
                src, offload = list(run.values()), index % 2 == 0
                reads_loading = offload and bool(loading) and any(b in loading for b in src)
                batches.append(TransferBatch(offload, src, list(run), reads_loading))
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
