"""Rank 0's runner in a tensor-parallel group: the engine drives it as it drives a `ModelRunner`,
and each call goes to the workers as a step plan before rank 0 runs it on its own shard.

The scheduler, the radix tree and the block pool exist only on rank 0; the workers hold their KV
shards in the same block layout because they make exactly rank 0's runner calls, in order:
block copies, prefill passes, decode steps, output projections. Sampling happens once, on rank 0,
over the logits every rank gathers.

A failure on any rank (a worker that crashed, a collective that timed out) raises
`TensorParallelError` from the call that met it, and every later call raises it at once: the
group cannot go on after losing a rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from radixinfer.distributed.launch import StartedGroup
from radixinfer.distributed.runner_calls import (
    DecodeCall,
    DecodeTableSender,
    LogitsCall,
    PrefillCall,
    RunnerCall,
    StopCall,
    as_array,
)
from radixinfer.engine.kv_store import KVStore
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.engine.sampler import Sampler
from radixinfer.models.base import PagedCausalLM


class TensorParallelError(RuntimeError):
    """The tensor-parallel group lost a rank or timed out; the engine cannot step any more."""


class TensorParallelRunner:
    """`ModelRunner`'s interface for the engine, over rank 0's runner (``local``) and the workers
    of ``group``."""

    def __init__(self, local: ModelRunner, group: StartedGroup) -> None:
        self.local = local
        self.tp = group.tp
        self._group = group
        self._tables = DecodeTableSender()
        self._copies: list[tuple[int, int]] = []  # made here since the last plan
        self._failure: str | None = None
        self._closed = False

    # what the engine and the front ends read of a runner
    @property
    def model(self) -> PagedCausalLM:
        return self.local.model

    @property
    def max_context_len(self) -> int:
        return self.local.max_context_len

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def kv(self) -> KVStore:
        return self.local.kv

    @property
    def sampler(self) -> Sampler:
        return self.local.sampler

    @property
    def prefill_max_seqs(self) -> int:
        return self.local.prefill_max_seqs

    @property
    def weight_read_bytes(self) -> int:
        return self.local.weight_read_bytes

    @property
    def last_decode_read_bytes(self) -> int:
        return self.local.last_decode_read_bytes

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the workers this process started (none under torchrun)."""
        return list(self._group.worker_pids)

    # ------------------------------------------------------------------ the mirrored calls
    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy here now; the workers copy before the forward of the next plan."""
        self._check_usable()
        self.local.copy_blocks(copies)
        self._copies.extend(copies)

    def prefill(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
    ) -> torch.Tensor:
        plan = PrefillCall(
            self._take_copies(), as_array(input_ids), as_array(positions), as_array(slots),
            [list(t) for t in tables], as_array(context_lens), as_array(query_lens),
        )  # fmt: skip
        return self._run(
            plan,
            lambda: self.local.prefill(
                input_ids, positions, slots, tables, context_lens, query_lens
            ),
        )

    def decode(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[list[int]],
        context_lens: Sequence[int],
        carried: torch.Tensor | None = None,
        carried_rows: Sequence[int] | None = None,
        changed_tables: Sequence[int] | None = None,
    ) -> torch.Tensor:
        keys, entries = self._tables.encode(tables, changed_tables)
        plan = DecodeCall(
            self._take_copies(), as_array(input_ids), as_array(positions), as_array(slots),
            keys, entries, as_array(context_lens),
            0 if carried is None else carried.shape[0],
            None if carried is None else carried.dtype,
            None if carried_rows is None else list(carried_rows),
            None if changed_tables is None else list(changed_tables),
        )  # fmt: skip

        def run() -> torch.Tensor:
            if carried is not None:
                self.tp.broadcast(carried.contiguous())
            return self.local.decode(
                input_ids, positions, slots, tables, context_lens, carried, carried_rows,
                changed_tables,
            )  # fmt: skip

        return self._run(plan, run)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every rank projects rank 0's rows (a cached prompt's rows come from rank 0's tree)."""
        hidden = hidden.contiguous()
        plan = LogitsCall(self._take_copies(), hidden.shape[0])
        return self._run(plan, lambda: self.local.logits(self.tp.broadcast(hidden)))

    # ------------------------------------------------------------------ plumbing
    def _take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def _check_usable(self) -> None:
        if self._closed:
            raise TensorParallelError("the engine is closed")
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def _run(self, plan: RunnerCall, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Send ``plan``, then make the call here; a failure of the group becomes
        `TensorParallelError` and disables the runner."""
        self._check_usable()
        try:
            self.tp.send_plan(plan)
            return call()
        except RuntimeError as exc:  # gloo / NCCL errors: a rank is gone or hangs
            self._failure = (
                f"a tensor-parallel step failed ({exc}); {self._group.describe_workers()}; "
                "the engine cannot go on: close it and start a new one"
            )
            raise TensorParallelError(self._failure) from exc

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent).

        Order: the workers are told to stop (each releases its CUDA graphs, then leaves the
        group); rank 0 releases its own graphs, waits for the workers, then leaves the group
        (`TensorParallel.close` says why the graphs go first). After a failed step the graphs are
        left as they are: the device may never become idle again."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            try:
                self.tp.send_plan(StopCall())
            except RuntimeError:
                pass  # a worker already gone: stopping the others below is all that is left
            self.local.graphs.release()
        self._group.stop_workers()
        self.tp.close()
