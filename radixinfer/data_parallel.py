"""Data parallelism: `DataParallelLLM` serves M engine replicas, each a whole copy of the model
with its own KV pool and radix tree, as one front with `AsyncLLM`'s interface (what
``radixinfer serve --data-parallel-size M`` runs)::

    add_request / submit ──▶ queued ──▶ router thread: ask every replica's tree (cache_aware),
                                         `Router.place`, then that replica's `AsyncLLM.submit_checked`
    replica r's events ──▶ its sink wrapper (a request that ends leaves the router's books) ──▶ sink

Routing (`radixinfer.router`) runs on a thread of its own, in rounds: every request queued since
the last round goes in the next, and a ``cache_aware`` round asks each replica once, with one
`AsyncLLM.call` carrying all the round's prompts, how many leading tokens of each its tree holds
under the request's cache salt (`cached_prefix_lens`: the replica's own tree, so the answer is
exact, for the token ids the engine runs). A replica answers between two steps, so a round waits
for at most one step of each replica. ``round_robin`` and ``least_loaded`` ask nothing.

Replica ``r`` runs in an engine process of its own (`replica_processes`): on CUDA it sees only its
GPUs, ``tensor_parallel_size`` of them from GPU ``first + r * tensor_parallel_size`` (its
``CUDA_VISIBLE_DEVICES``, mapped through this process's own), on a CPU it is another process.
Request ids are the front's; a request's stream, abort and timeout work as with `AsyncLLM`. A
replica whose engine dies fails its own requests; later requests go to the others, and
`stats` (``/health``) raises its error.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np

from radixinfer.api import LLM
from radixinfer.async_llm import AsyncLLM, EngineLoopError, QueueFullError
from radixinfer.async_stream import StreamFront, check_front_options
from radixinfer.cache.tree_node import as_token_array
from radixinfer.core_messages import Sink, StreamEvents, StreamFailure
from radixinfer.engine_process import EngineProcess
from radixinfer.outputs import StreamDelta, TokenBatch
from radixinfer.router import Router
from radixinfer.sampling_params import SamplingParams

T = TypeVar("T")
DEFAULT_LOAD_MARGIN = 32  # requests in flight; SGLang's router balances past the same count


def cached_prefix_lens(llm: LLM, prompts: list[tuple[np.ndarray, Hashable]]) -> list[int]:
    """How many leading tokens of each ``(token ids, cache salt)`` the prefix cache of ``llm`` holds
    now (in either tier), as admission would match them; changes and counts nothing."""
    cache = llm.engine.cache
    if not cache.enable_prefix_cache:
        return [0] * len(prompts)
    return [cache.tree.match(as_token_array(ids), salt).total_length for ids, salt in prompts]


def replica_processes(llm_kwargs: dict[str, Any], data_parallel_size: int) -> list[EngineProcess]:
    """One `EngineProcess` per replica of `LLM` ``llm_kwargs``. On CUDA (``device`` ``"cuda"`` or
    ``"cuda:i"``), replica ``r`` sees GPUs ``i + r * tp .. i + (r + 1) * tp - 1`` of this process's
    (``tp``: ``tensor_parallel_size``) and runs on its first; ``ValueError`` when there are not
    that many."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    device = str(llm_kwargs.get("device", "cpu"))
    if not device.startswith("cuda"):
        return [EngineProcess(**llm_kwargs) for _ in range(data_parallel_size)]
    import torch

    tp = int(llm_kwargs.get("tensor_parallel_size", 1))
    first = int(device.partition(":")[2] or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    needed = first + data_parallel_size * tp
    if needed > len(gpus):
        raise ValueError(
            f"data_parallel_size: {data_parallel_size} replicas x tensor_parallel_size {tp} from "
            f"{device} need {needed} GPUs; {len(gpus)} are visible"
        )
    kwargs = {**llm_kwargs, "device": "cuda"}
    return [
        EngineProcess(
            environment={
                "CUDA_VISIBLE_DEVICES": ",".join(gpus[first + r * tp : first + (r + 1) * tp])
            },
            **kwargs,
        )
        for r in range(data_parallel_size)
    ]


def start_replicas(replicas: Sequence[LLM | EngineProcess]) -> list[AsyncLLM]:
    """An `AsyncLLM` over each replica, engine processes started at once; if one fails, the others
    are closed and ``RuntimeError`` names the first that failed (its error as the cause)."""
    fronts: list[AsyncLLM | None] = [None] * len(replicas)
    errors: dict[int, BaseException] = {}

    def start(i: int) -> None:
        try:
            fronts[i] = AsyncLLM(replicas[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for front in fronts:
            if front is not None:
                front.close()
        i = min(errors)
        raise RuntimeError(
            f"data-parallel replica {i} of {len(replicas)} failed to start: {errors[i]!r}"
        ) from errors[i]
    return [front for front in fronts if front is not None]


def add_stats(snapshots: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' ``cache_stats()`` (or `AsyncLLM.stats`) snapshots as one: counts summed,
    ``hit_rate`` and ``load_gb_per_s`` taken from the sums."""
    total = {key: sum(s[key] for s in snapshots) for key in snapshots[0]}
    total["hit_rate"] = (
        total["cached_tokens"] / total["prompt_tokens"] if total["prompt_tokens"] else 0.0
    )
    seconds = total["load_seconds"]
    total["load_gb_per_s"] = total["loaded_bytes"] / seconds / 1e9 if seconds else 0.0
    return total


@dataclass(slots=True)
class _Queued:
    request_id: str
    prompt: np.ndarray
    params: SamplingParams
    salt: Hashable
    sink: Sink


class _ReplicaSink:
    """A caller's sink as one replica sees it: requests that end there leave the router's books
    before their events go on. One per (replica, sink), so a step's events stay one list."""

    __slots__ = ("front", "sink")

    def __init__(self, front: DataParallelLLM, sink: Sink) -> None:
        self.front = front
        self.sink = sink

    def put(self, events: StreamEvents) -> None:
        ended = [e.request_id for e in events if type(e) is not TokenBatch and e.finished]
        if ended:
            self.front._ended(ended)
        self.sink.put(events)


class DataParallelLLM(StreamFront):
    """Serves ``replicas`` (each an `LLM`, stepped on a thread of this process, or an
    `EngineProcess`; the same model) as one front until `close`, routing each request by
    ``policy`` (`radixinfer.router.POLICIES`); ``load_margin``: a replica more than this many
    requests in flight busier than the least loaded is skipped by ``cache_aware``.
    ``max_waiting`` bounds the requests queued here or for admission in any replica;
    ``request_timeout`` is the default timeout of `add_request`. The constructor returns once every
    replica has loaded.

    The interface is `AsyncLLM`'s (`add_request`, `generate`, `submit`, `abort`, `stats`,
    `cache_stats`, `reset_prefix_cache`, `close`); `stats` and `cache_stats` add the replicas up
    (``stats`` also lists each one's under ``"replicas"``, with ``routed``: requests sent to it)."""

    def __init__(
        self,
        replicas: Sequence[LLM | EngineProcess],
        *,
        policy: str = "cache_aware",
        load_margin: int = DEFAULT_LOAD_MARGIN,
        max_waiting: int | None = None,
        request_timeout: float | None = None,
    ) -> None:
        check_front_options(max_waiting, request_timeout)
        self._router = Router(len(replicas), policy, load_margin)
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.replicas = start_replicas(replicas)
        self._open_streams(self.replicas[0].prompts)
        self._lock = threading.Condition()  # the router's books, the queue, the sink wrappers
        self._ids = itertools.count()
        self._queue: list[_Queued] = []
        self._unplaced: set[str] = set()  # submitted, not yet on a replica
        self._aborted: set[str] = set()  # of those, aborted
        self._placed: dict[str, tuple[int, list[int]]] = {}  # -> (replica, router keys)
        self._sinks: dict[tuple[int, Sink], _ReplicaSink] = {}
        self._closing = False
        self._error: EngineLoopError | None = None  # the router's own failure
        self._thread = threading.Thread(
            target=self._route_all, name="radixinfer-router", daemon=True
        )
        self._thread.start()

    @property
    def policy(self) -> str:
        return self._router.policy

    @policy.setter
    def policy(self, policy: str) -> None:
        """Route later requests by ``policy`` (a benchmark compares them on the same replicas)."""
        with self._lock:
            self._router.set_policy(policy)

    @property
    def num_waiting(self) -> int:
        """Requests queued here or for admission in a replica."""
        return len(self._unplaced) + sum(replica.num_waiting for replica in self.replicas)

    @property
    def engine_pids(self) -> list[int | None]:
        return [replica.engine_pid for replica in self.replicas]

    # ------------------------------------------------------------------ any thread
    def submit_checked(
        self, prompt_ids: np.ndarray, params: SamplingParams, cache_salt: Hashable, sink: Sink
    ) -> str:
        """`AsyncLLM.submit_checked`: queue a request whose events go to ``sink``; returns its id at
        once. It reaches a replica when the router places it; an error there (every replica down)
        comes as a `StreamFailure`."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._closing:
                raise RuntimeError("DataParallelLLM is closed")
            if all(replica.error is not None for replica in self.replicas):
                raise self.replicas[0].error
            if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            request_id = f"req-{next(self._ids)}"
            self._queue.append(_Queued(request_id, prompt_ids, params, cache_salt, sink))
            self._unplaced.add(request_id)
            self._lock.notify()
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued here, or on its replica)."""
        with self._lock:
            placed = self._placed.get(request_id)
            if placed is None:
                if request_id in self._unplaced:
                    self._aborted.add(request_id)
                return
        self.replicas[placed[0]].abort(request_id)

    def call_all(self, fn: Callable[[LLM], T]) -> list[Future[T]]:
        """`AsyncLLM.call` on every replica, in replica order."""
        return [replica.call(fn) for replica in self.replicas]

    def close(self) -> None:
        """Fail what is still queued, abort what runs, stop every replica. Idempotent."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join()
        for replica in self.replicas:
            replica.close()

    def __enter__(self) -> DataParallelLLM:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ coroutine side
    async def stats(self) -> dict[str, Any]:
        """Every replica's `AsyncLLM.stats` added up, and each one's (with ``routed``) under
        ``"replicas"``; raises a dead replica's error."""
        snapshots = await asyncio.gather(*(replica.stats() for replica in self.replicas))
        routed = list(self._router.routed)
        each = [{**s, "routed": n} for s, n in zip(snapshots, routed)]
        total = add_stats(snapshots)
        total["waiting"] += len(self._unplaced)  # queued here, for no replica yet
        return {**total, "routed": sum(routed), "replicas": each}

    async def cache_stats(self) -> dict[str, Any]:
        """Every replica's ``cache_stats()`` added up."""
        return add_stats(await asyncio.gather(*(r.cache_stats() for r in self.replicas)))

    async def reset_prefix_cache(self) -> None:
        """Empty every replica's prefix cache; ``RuntimeError`` when one refuses (requests hold KV
        there), after the others have emptied theirs."""
        results = await asyncio.gather(
            *(r.reset_prefix_cache() for r in self.replicas), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    # ------------------------------------------------------------------ router thread
    def _route_all(self) -> None:
        """Place queued requests, a round at a time, until `close` (which fails what is still
        queued). A failure of the router itself fails every queued request and every later
        `submit` (never a caller left waiting)."""
        batch: list[_Queued] = []
        error: BaseException = RuntimeError("DataParallelLLM is closed")
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._closing:
                        self._lock.wait()
                    batch, self._queue = self._queue, []
                    if self._closing:
                        break
                    needs_trees = self._router.needs_trees
                cached = self._ask_trees(batch) if needs_trees else [None] * len(batch)
                while batch:  # a request leaves the batch once placed
                    self._place(batch[0], cached[len(cached) - len(batch)])
                    batch.pop(0)
        except BaseException as exc:  # noqa: BLE001 - handed to every caller
            error = EngineLoopError(f"the data-parallel router failed: {exc!r}")
            error.__cause__ = exc
            with self._lock:
                self._error, self._closing = error, True
                batch += self._queue
        for queued in batch:
            queued.sink.put([StreamFailure(queued.request_id, error)])

    def _ask_trees(self, batch: list[_Queued]) -> list[list[int]]:
        """Per request of ``batch``, how many leading tokens each replica's tree holds (0 for a
        replica that is down)."""
        ask = partial(cached_prefix_lens, prompts=[(q.prompt, q.salt) for q in batch])
        answers: list[Future[list[int]] | None] = []
        for replica in self.replicas:
            try:
                answers.append(replica.call(ask) if replica.error is None else None)
            except Exception:  # noqa: BLE001 - a replica closing or dead: it gets nothing
                answers.append(None)
        per_replica = []
        for answer in answers:
            try:
                per_replica.append(answer.result() if answer is not None else None)
            except Exception:  # noqa: BLE001 - died meanwhile
                per_replica.append(None)
        zeros = [0] * len(batch)
        return [list(lengths) for lengths in zip(*(a or zeros for a in per_replica))]

    def _place(self, queued: _Queued, cached: list[int] | None) -> None:
        request_id = queued.request_id
        ending: StreamDelta | StreamFailure | None = None
        with self._lock:
            self._unplaced.discard(request_id)
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                ending = StreamDelta(request_id, [], "", True, "abort", 0, time.perf_counter())
            else:
                down = [r for r, replica in enumerate(self.replicas) if replica.error is not None]
                try:
                    replica, keys = self._router.place(queued.prompt, queued.salt, cached, down)
                except RuntimeError as exc:
                    ending = StreamFailure(request_id, exc)
                else:
                    ending = self._submit(queued, replica, keys)
        if ending is not None:
            queued.sink.put([ending])

    def _submit(self, queued: _Queued, replica: int, keys: list[int]) -> StreamFailure | None:
        """Hand ``queued`` to ``replica`` (with the lock held, so an abort finds it placed)."""
        request_id = queued.request_id
        self._placed[request_id] = (replica, keys)
        sink = self._sinks.get((replica, queued.sink))
        if sink is None:
            sink = self._sinks[replica, queued.sink] = _ReplicaSink(self, queued.sink)
        try:
            self.replicas[replica].submit_checked(
                queued.prompt, queued.params, queued.salt, sink, request_id=request_id
            )
        except Exception as exc:  # noqa: BLE001 - the replica died or refused: the caller hears
            del self._placed[request_id]
            self._router.release(replica, keys)
            return StreamFailure(request_id, exc)
        return None

    def _ended(self, request_ids: list[str]) -> None:
        """Requests that have ended on their replica leave the router's books."""
        with self._lock:
            for request_id in request_ids:
                placed = self._placed.pop(request_id, None)
                if placed is not None:
                    self._router.release(*placed)
