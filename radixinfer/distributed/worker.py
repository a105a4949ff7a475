"""A tensor-parallel worker: rank ``r`` > 0 builds its shard of the runner, then makes every runner
call rank 0 sends, in order, until rank 0 says stop (or goes away).

Workers have no scheduler, no tree and no block pool: the calls carry the block tables and slots,
so each worker's KV shard follows rank 0's block layout exactly. Their logits are gathered for rank
0 and dropped here.
"""

from __future__ import annotations

import logging

import torch

from radixinfer.distributed.group import RankFailed, TensorParallel
from radixinfer.distributed.runner_calls import (
    DecodeCall,
    DecodeTableReceiver,
    LogitsCall,
    PrefillCall,
    StopCall,
)
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.engine.runner_setup import RunnerSpec, build_runner, inline_host_ops

logger = logging.getLogger(__name__)


def run_worker(tp: TensorParallel, device: torch.device, spec: RunnerSpec) -> None:
    """Build this rank's runner with the others, then follow rank 0's calls until it stops; leaves
    the group when done, after releasing the runner's CUDA graphs (`TensorParallel.close` says
    why). A setup failure is reported to rank 0 (which raises it) and ends the worker quietly; a
    failure while stepping propagates (rank 0 sees the rank go away)."""
    try:
        try:
            built = build_runner(spec, device, tp)
        except (ValueError, RankFailed) as exc:
            logger.debug("tensor-parallel rank %d: setup failed: %s", tp.rank, exc)
            return
        inline_host_ops(device)
        follow_calls(built.runner, tp)
        built.runner.graphs.release()
    finally:
        tp.close()


def follow_calls(runner: ModelRunner, tp: TensorParallel) -> None:
    """Make rank 0's runner calls on this rank's runner until a `StopCall`."""
    tables = DecodeTableReceiver()
    device, dtype = runner.device, runner.kv.k.dtype
    while True:
        call = tp.receive_plan()
        if isinstance(call, StopCall):
            return
        runner.copy_blocks(call.copies)
        if isinstance(call, PrefillCall):
            runner.prefill(
                call.input_ids, call.positions, call.slots, call.tables, call.context_lens,
                call.query_lens,
            )  # fmt: skip
        elif isinstance(call, DecodeCall):
            carried = None
            if call.num_carried:
                carried = torch.empty(call.num_carried, dtype=call.carried_dtype, device=device)
                tp.broadcast(carried)
            runner.decode(
                call.input_ids, call.positions, call.slots,
                tables.decode(call.table_keys, call.table_entries), call.context_lens,
                carried, call.carried_rows, call.changed_tables,
            )  # fmt: skip
        elif isinstance(call, LogitsCall):
            hidden_size = runner.model.hidden_size
            hidden = torch.empty(call.num_rows, hidden_size, dtype=dtype, device=device)
            runner.logits(tp.broadcast(hidden))
        else:
            raise TypeError(f"unknown runner call {type(call).__name__}")
