"""This process's place in a tensor-parallel group, and the collectives the engine uses over it.

A group has two process groups over the same ranks:

* the **device group** carries the model's tensors: the all-reduces after attention and after the
  MLP, the all-gather of the logits, the sampled tokens and hidden rows rank 0 hands the workers.
  NCCL on CUDA (its collectives are captured in CUDA graphs like any kernel), gloo on a CPU.
* the **control group** (gloo, on the CPU) carries rank 0's step plans to the workers and the
  start-up handshakes: pickled objects, never a device tensor.

The groups are built without torch's global default group (the construction vLLM uses for its
stateless groups), so several engines, each with its own workers, can live in one process (the
benchmark keeps its compared variants open at once).

Timeouts: a collective on the device group fails after ``step_timeout`` (a rank that hangs
mid-step); the control group waits as long as rank 0 stays idle (a worker waits for the next plan),
but a rank that dies closes its sockets, and every other rank's next operation then fails at once.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup, Store

logger = logging.getLogger(__name__)

END_TIMEOUT_S = 10.0  # the longest `TensorParallel.close` waits for one group to end
STEP_TIMEOUT = timedelta(minutes=10)  # one collective of a step; first steps may compile kernels
IDLE_TIMEOUT = timedelta(days=365)  # a worker waiting for rank 0's next step plan


class RankFailed(RuntimeError):
    """Another rank of the group failed: raised on this rank with that rank's message."""


def _process_group(
    store: Store, prefix: str, rank: int, size: int, device: torch.device, timeout: timedelta
) -> ProcessGroup:
    """A process group over ``store`` that is not registered as torch's default group: NCCL for a
    CUDA ``device``, else gloo."""
    prefixed = PrefixStore(prefix, store)
    group = ProcessGroup(prefixed, rank, size)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        backend_type = ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        backend_type = ProcessGroup.BackendType.GLOO
    group._set_default_backend(backend_type)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device(device.type), backend_type, backend)
    return group


@dataclass(eq=False)
class TensorParallel:
    """Rank ``rank`` of ``size`` ranks that each hold a shard of every layer.

    `TensorParallel.single` (size 1) has no groups: every collective is the identity, and the
    layers built with it compute exactly what the unsharded layers do. A group with ``size`` > 1
    comes from `TensorParallel.connect`; ``device_group`` None is a rank that only loads its
    shard (nothing is exchanged: the collectives must not be called).
    """

    rank: int
    size: int
    device_group: ProcessGroup | None = None
    control_group: ProcessGroup | None = None
    store: Store | None = None  # where the ranks met; kept alive as long as the groups

    @classmethod
    def single(cls) -> TensorParallel:
        return cls(0, 1)

    @classmethod
    def connect(
        cls,
        store: Store,
        rank: int,
        size: int,
        device: torch.device,
        step_timeout: timedelta = STEP_TIMEOUT,
    ) -> TensorParallel:
        """Join the group whose ranks meet at ``store`` (every rank calls this with its own
        ``rank`` and ``device``)."""
        cpu = torch.device("cpu")
        control = _process_group(store, "control", rank, size, cpu, IDLE_TIMEOUT)
        device_group = _process_group(store, "device", rank, size, device, step_timeout)
        return cls(rank, size, device_group, control, store)

    @property
    def is_driver(self) -> bool:
        """Whether this rank schedules and samples (rank 0); the others follow its plans."""
        return self.rank == 0

    # ------------------------------------------------------------------ model tensors
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, d]`` on each rank -> ``[size * n, d]``: rank ``r``'s rows at ``r * n``."""
        if self.size == 1:
            return x
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.device_group)
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere); returns it."""
        dist.broadcast(x, group=self.device_group, group_src=0)
        return x

    # ------------------------------------------------------------------ plans and handshakes
    def send_plan(self, plan: object) -> None:
        """Rank 0: hand ``plan`` (any picklable value) to every worker."""
        dist.broadcast_object_list([plan], group=self.control_group, group_src=0)

    def receive_plan(self) -> object:
        """A worker: wait for rank 0's next `send_plan` and return its value."""
        box = [None]
        dist.broadcast_object_list(box, group=self.control_group, group_src=0)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank gives (every rank calls it)."""
        if self.size == 1:
            return value
        values: list[int | None] = [None] * self.size
        dist.all_gather_object(values, value, group=self.control_group)
        return min(values)

    @contextmanager
    def on_every_rank(self, what: str) -> Iterator[None]:
        """Run the body on every rank, then make sure all of them succeeded: a rank whose body
        raised re-raises its error; the others raise `RankFailed` (a ``ValueError`` there was a
        ``ValueError`` here too, so bad input reads as bad input on rank 0) naming that rank.
        ``what``: what the body does, for the message."""
        if self.size == 1:
            yield
            return
        failure: tuple[bool, str] | None = None
        try:
            yield
        except Exception as exc:
            is_value_error = isinstance(exc, ValueError)
            failure = (is_value_error, str(exc) if is_value_error else traceback.format_exc())
            self._gather_failures(failure)
            raise
        failures = self._gather_failures(None)
        for rank, failed in enumerate(failures):
            if failed is not None:
                is_value_error, message = failed
                error = ValueError if is_value_error else RankFailed
                raise error(f"tensor-parallel rank {rank} failed to {what}: {message}")

    def _gather_failures(self, failure: tuple[bool, str] | None) -> list[tuple[bool, str] | None]:
        failures: list[tuple[bool, str] | None] = [None] * self.size
        dist.all_gather_object(failures, failure, group=self.control_group)
        return failures

    def close(self) -> None:
        """Leave the group (this object is unusable after). The device group is aborted rather
        than shut down in order: an NCCL communicator that CUDA graphs captured can hang in an
        orderly destroy (pytorch/pytorch#115388), and nothing is in flight by now; its abort
        returns only once those graphs are gone, so the caller releases them first
        (`StepGraphs.release`, see docs/multi-gpu.md). Neither end blocks the caller longer than
        ``END_TIMEOUT_S`` each (see `_end_group`)."""
        for group, end in ((self.device_group, "abort"), (self.control_group, "shutdown")):
            if group is not None:
                _end_group(group, end)
        self.device_group = self.control_group = self.store = None


def _end_group(group: ProcessGroup, end: str, timeout_s: float = END_TIMEOUT_S) -> None:
    """``group.abort()`` or ``group.shutdown()`` (``end``), waited for at most ``timeout_s``.

    It runs on a daemon thread: on H200s with torch 2.11 an NCCL group whose all-reduces CUDA
    graphs captured was seen to hang in its abort as well as in an orderly destroy. A group that
    does not end in time is left to the process's exit (its communicator leaks until then) rather
    than hanging `LLM.close`. A group whose other ranks are gone may raise instead: nothing is
    left to end then."""

    def run() -> None:
        try:
            getattr(group, end)()
        except RuntimeError:
            pass

    thread = threading.Thread(target=run, name=f"radixinfer-tp-{end}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning(
            "tensor-parallel %s did not finish in %.0f s; left to the process exit", end, timeout_s
        )
