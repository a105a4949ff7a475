"""Where the ranks of a tensor-parallel group come from.

* **One host** (the default): `LLM` is rank 0 and starts ranks ``1 .. size - 1`` itself, as
  processes of torch.multiprocessing's spawn context; rank ``r`` uses the GPU ``first + r``
  (``first``: the index of the device `LLM` was given) or the CPU. They meet at a TCP store on the
  loopback interface whose port the OS picks.
* **torchrun** (several hosts, or one): torchrun starts every rank with ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; rank 0 builds the `LLM` (``radixinfer
  serve`` / ``bench``), every other rank runs `radixinfer.api.run_tensor_parallel_rank` (the CLI
  does this by itself), and rank ``r`` uses the GPU ``LOCAL_RANK``.

A spawned worker that dies before joining is noticed while rank 0 waits for it (its exit code is
in the error), not after a timeout.
"""

from __future__ import annotations

import multiprocessing.process
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixinfer.distributed.group import TensorParallel
from radixinfer.distributed.torchrun import torchrun_rank
from radixinfer.distributed.worker import run_worker
from radixinfer.engine.runner_setup import RunnerSpec
from radixinfer.lifetime import exit_with_parent

CONNECT_TIMEOUT = timedelta(minutes=5)  # every rank started and connected
STOP_TIMEOUT_S = 30.0  # a stopped worker leaves its step loop and exits


@dataclass
class StartedGroup:
    """Rank 0's membership of a started group: the group, rank 0's device, and its workers: their
    process ids when this process started them, a line on their state for errors (exit codes),
    and how to wait for them once told to stop (ending those that do not leave)."""

    tp: TensorParallel
    device: torch.device
    worker_pids: list[int]
    describe_workers: Callable[[], str]
    stop_workers: Callable[[], None]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of rank ``rank`` on this host: ``cuda:(first + rank)`` for a CUDA ``device``
    (``LOCAL_RANK`` under torchrun), else ``device``."""
    if device.type != "cuda":
        return device
    if torchrun_rank() is not None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cuda", (device.index or 0) + rank)


def start_group(size: int, device: torch.device, spec: RunnerSpec) -> StartedGroup:
    """Rank 0 of a group of ``size`` ranks: join torchrun's ranks when torchrun started this
    process, else spawn the workers on this host. Raises ``ValueError`` naming
    ``tensor_parallel_size`` when the ranks or GPUs do not match it."""
    if torchrun_rank() is not None:
        return _join_torchrun(size, device)
    if device.type == "cuda":
        first = device.index or 0
        if first + size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={size} needs GPUs cuda:{first}..cuda:{first + size - 1}, "
                f"but {torch.cuda.device_count()} are visible"
            )
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=CONNECT_TIMEOUT
    )
    context = mp.get_context("spawn")
    workers = [
        context.Process(
            target=_spawned_worker,
            args=(rank, size, store.port, str(rank_device(device, rank)), spec),
            name=f"radixinfer-tp{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for worker in workers:
        worker.start()
    try:
        _wait_until_ready(store, workers)
        local = rank_device(device, 0)
        tp = TensorParallel.connect(store, 0, size, local)
    except BaseException:
        _stop(workers, timeout_s=0.0)
        raise
    pids = [w.pid for w in workers]
    return StartedGroup(
        tp, local, pids, lambda: _describe(workers, settle_s=2.0), lambda: _stop(workers)
    )


def join_as_worker(device: torch.device, spec: RunnerSpec) -> None:
    """A torchrun rank > 0: join the group and follow rank 0 until it stops."""
    store, rank, size = next(dist.rendezvous("env://", timeout=CONNECT_TIMEOUT))
    local = rank_device(device, rank)
    if local.type == "cuda":
        torch.cuda.set_device(local)
    run_worker(TensorParallel.connect(store, rank, size, local), local, spec)


_torchrun_group_joined = False  # torchrun's ranks form one group: one engine per launch


def _join_torchrun(size: int, device: torch.device) -> StartedGroup:
    global _torchrun_group_joined
    rank, world_size = torchrun_rank(), int(os.environ["WORLD_SIZE"])
    if world_size != size:
        raise ValueError(
            f"tensor_parallel_size={size}, but torchrun started WORLD_SIZE={world_size} ranks"
        )
    if rank != 0:
        raise ValueError(
            f"this is torchrun rank {rank}: only rank 0 builds the LLM; the other ranks run "
            "radixinfer.api.run_tensor_parallel_rank with the same arguments"
        )
    if _torchrun_group_joined:
        raise ValueError(
            "under torchrun a process builds one tensor-parallel LLM (its ranks serve one "
            "engine); close it and start a new launch for another"
        )
    _torchrun_group_joined = True
    store, _, _ = next(dist.rendezvous("env://", timeout=CONNECT_TIMEOUT))
    local = rank_device(device, 0)
    if local.type == "cuda":
        torch.cuda.set_device(local)
    tp = TensorParallel.connect(store, 0, size, local)
    return StartedGroup(
        tp, local, [], lambda: "the other ranks' logs say why (torchrun started them)", lambda: None
    )


def _spawned_worker(rank: int, size: int, port: int, device_name: str, spec: RunnerSpec) -> None:
    """A spawned worker process's body; it ends with rank 0's process (`exit_with_parent`)."""
    exit_with_parent()
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # share the host's cores between the ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=CONNECT_TIMEOUT)
    store.set(f"ready/{rank}", "1")
    run_worker(TensorParallel.connect(store, rank, size, device), device, spec)


def _wait_until_ready(
    store: dist.TCPStore, workers: list[multiprocessing.process.BaseProcess]
) -> None:
    """Wait until every worker has reached the store; RuntimeError as soon as one has died."""
    keys = [f"ready/{rank}" for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while not store.check(keys):
        if any(not w.is_alive() for w in workers):
            raise RuntimeError(
                f"a tensor-parallel worker exited while starting: {_describe(workers)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start in {CONNECT_TIMEOUT}")
        time.sleep(0.05)


def _describe(workers: list[multiprocessing.process.BaseProcess], settle_s: float = 0.0) -> str:
    """The workers' states; ``settle_s``: first give a worker whose sockets closed that long to be
    reaped (its exit code comes a moment after its peers see the connection drop)."""
    deadline = time.monotonic() + settle_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    states = [
        f"rank {rank}: " + ("running" if w.exitcode is None else f"exited with code {w.exitcode}")
        for rank, w in enumerate(workers, start=1)
    ]
    return "workers " + ", ".join(states)


def _stop(
    workers: list[multiprocessing.process.BaseProcess], timeout_s: float = STOP_TIMEOUT_S
) -> None:
    """Wait up to ``timeout_s`` for the workers to exit (they were told to stop), then end those
    still running."""
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(5.0)
        if worker.is_alive():
            worker.kill()
            worker.join()
