"""The all-reduce of small messages over CUDA symmetric memory: each rank maps every other rank's
buffer, so a sum is a few loads and stores over NVLink in one kernel, without NCCL's protocol.
On H200s at two ranks, torch's two-shot op took about half of NCCL's time for a decode step's
``[batch, 4096]`` bf16 activations in a CUDA graph (8-10 µs against 16-19 µs at batch 1-64, measured
on torch's default group); ``benchmarks/bench_allreduce.py`` compares the two paths as the engine
runs them.

One all-reduce of ``x`` (`SymmetricAllReduce.all_reduce`)::

    x ──copy──▶ buffer[:n] ──two_shot_all_reduce_ (in place)──▶ buffer[:n] ──copy──▶ x
                            barrier · reduce own shard · write it to every rank · barrier

Why two-shot and not one-shot: ``one_shot_all_reduce`` has no barrier at its end, so a rank that
runs ahead copies the next all-reduce's input into its buffer while a slower peer is still reading
the previous one there (wrong sums were seen in the model that way). ``two_shot_all_reduce_``
ends with a barrier: once it returns on any rank, no peer touches that rank's buffer again until
every rank has entered the next all-reduce. This is vLLM's construction (``SymmMemCommunicator``)
for two ranks on Hopper.

What must hold: every rank of the group makes the same all-reduces in the same order (true of the
model's collectives); the buffer exists and is rendezvoused before any CUDA graph captures an
all-reduce (`connect` runs when the group is built); multicast (NVLS) is not used, so no
``multimem`` op appears here. A peer that dies in the middle of an all-reduce leaves the others
spinning in the barrier (NCCL would time out instead); a dead worker is normally seen earlier,
when rank 0's step plan cannot reach it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup, Store

logger = logging.getLogger(__name__)

# The largest message per group size; larger ones go to NCCL (vLLM's caps for Hopper). Sizes not
# listed always use NCCL.
MAX_BYTES = {2: 8 << 20, 4: 32 << 20}
DTYPES = (torch.bfloat16, torch.float32)  # those torch's two-shot kernel sums
ALIGNMENT = 16  # bytes; the kernel's vector width


def why_not(device: torch.device, size: int, enabled: bool) -> str | None:
    """Why a rank on ``device`` in a group of ``size`` cannot use symmetric memory, or None when it
    can try (the rendezvous may still fail: see `connect`)."""
    if not enabled:
        return "turned off (disable_custom_all_reduce)"
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if size not in MAX_BYTES:
        return f"no size cap for {size} ranks (only {sorted(MAX_BYTES)})"
    try:
        torch.ops.symm_mem.two_shot_all_reduce_  # noqa: B018 - raises when the op is missing
    except (AttributeError, RuntimeError):
        return f"torch {torch.__version__} has no symm_mem.two_shot_all_reduce_"
    return None


class SymmetricAllReduce:
    """One group's symmetric buffer (``max_bytes`` bytes, mapped on every rank) and the
    all-reduce through it. ``group_name``: the registered name of the device group the buffer was
    rendezvoused over."""

    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self._buffer = buffer  # [max_bytes] uint8, viewed as each message's dtype
        self._group_name = group_name

    @property
    def max_bytes(self) -> int:
        return self._buffer.numel()

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the buffer: a contiguous bf16 or fp32 tensor on its device,
        of at most ``max_bytes`` bytes, whose size the kernel's vectors divide."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in DTYPES
            and x.device == self._buffer.device
            and x.is_contiguous()
            and nbytes <= self.max_bytes
            and nbytes % ALIGNMENT == 0
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (which `fits`) over the ranks, in place; returns ``x``. Capturable in a CUDA
        graph: everything runs on the current stream at fixed addresses."""
        flat = x.view(-1)
        staged = self._buffer.view(x.dtype)[: flat.numel()]
        staged.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self._group_name)
        flat.copy_(staged)
        return x


def connect(
    group: ProcessGroup,
    store: Store,
    device: torch.device,
    enabled: bool,
    all_gather: Callable[[object], list[object]],
) -> SymmetricAllReduce | None:
    """Every rank of ``group`` (a registered NCCL group of this host's GPUs) calls this at once;
    they all return a `SymmetricAllReduce`, or all None (NCCL then carries every all-reduce).
    ``store``: one the ranks share, for the rendezvous's own keys. ``all_gather``: a value from
    each rank, over another channel than ``group`` (the control group), by which the ranks agree.

    None when any rank gives a reason (`why_not`), when the ranks are on several hosts (their
    memory cannot be mapped across), or when the allocation or the rendezvous fails on any rank;
    rank 0 logs which, once. Never raises for those."""
    size = group.size()
    reasons = all_gather((socket.gethostname(), why_not(device, size, enabled)))
    reason = next((r for _, r in reasons if r is not None), None)
    if reason is None and len({host for host, _ in reasons}) > 1:
        reason = "the ranks are on several hosts"
    if reason is None:
        buffer, failure = _rendezvous(group, store, device, MAX_BYTES[size])
        failures = all_gather(failure)
        reason = next((f for f in failures if f is not None), None)
    if reason is not None:
        if group.rank() == 0:
            logger.info("tensor-parallel all-reduce: the process group's backend only (%s)", reason)
        return None
    if group.rank() == 0:
        logger.info("tensor-parallel all-reduce: symmetric memory up to %d bytes", buffer.numel())
    return SymmetricAllReduce(buffer, group.group_name)


def _rendezvous(
    group: ProcessGroup, store: Store, device: torch.device, max_bytes: int
) -> tuple[torch.Tensor | None, str | None]:
    """``(buffer, None)``: ``max_bytes`` of symmetric memory mapped on every rank of ``group``;
    ``(None, why)`` when it could not be made here."""
    # no multimem op runs here, so no NVLink multicast object is wanted (unless asked for)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory

        # What torch's deprecated enable_symm_mem_for_group does for a group of its own registry:
        # versions whose rendezvous does not look the group up by name read this instead.
        _SymmetricMemory.set_group_info(group.group_name, group.rank(), group.size(), store)
        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group.group_name)
    except Exception as exc:  # any failure here means NCCL, not a crash
        return None, f"symmetric memory rendezvous failed: {exc}"
    return buffer, None
