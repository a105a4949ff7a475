"""From the engine's options to a `ModelRunner` with its KV pool: load the model (this rank's shard
under tensor parallelism), plan the memory, allocate the pool.

Every rank of a tensor-parallel group runs `build_runner` with the same `RunnerSpec`, so every rank
builds the same runner: the same step buffers, the same CUDA graphs (captured in the same order,
their collectives matched across ranks) and the same number of KV blocks (the fewest any rank can
hold), hence the same block layout for the plans rank 0 sends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from transformers import PretrainedConfig

from radixinfer.attention import get_backend
from radixinfer.distributed.group import TensorParallel
from radixinfer.engine.host_kv import host_blocks_for, write_back_blocks
from radixinfer.engine.kv_store import KVStore
from radixinfer.engine.memory import (
    DeviceMemory,
    MemoryPlan,
    ProfiledMemory,
    module_bytes,
    plan_cpu_memory,
    plan_gpu_memory,
    resolve_max_model_len,
)
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.models import LoadedModel, load_model


@dataclass(frozen=True)
class RunnerSpec:
    """What a rank needs to build its runner; picklable (it travels to spawned workers).

    ``prefill_max_tokens`` / ``prefill_max_requests``: a prefill round's budget and requests (the
    admission settings); ``chunked_prefill`` False lets one prompt of the whole context run as one
    pass. ``num_blocks`` None: as many as the memory plan allows. ``host_cache_gb`` > 0: the plan
    also holds the host tier's write-back staging (`radixinfer.engine.host_kv`)."""

    model: str | os.PathLike | PretrainedConfig
    dtype: str | torch.dtype
    seed: int
    block_size: int
    num_blocks: int | None
    max_batch_size: int
    prefill_max_tokens: int
    prefill_max_requests: int
    chunked_prefill: bool
    max_model_len: int | None
    gpu_memory_utilization: float
    host_cache_gb: float = 0.0


@dataclass(frozen=True)
class BuiltRunner:
    """A runner bound to its KV pool, the model it runs, and the memory plan that sized the pool."""

    runner: ModelRunner
    loaded: LoadedModel
    memory_plan: MemoryPlan


def build_runner(
    spec: RunnerSpec, device: torch.device, tp: TensorParallel | None = None
) -> BuiltRunner:
    """Build this rank's runner (``tp`` None: the only rank). Raises ``ValueError`` for a bad
    option or a configuration that cannot fit, on every rank when any rank finds it."""
    tp = tp or TensorParallel.single()
    start = None
    with tp.on_every_rank("load the model"):
        if device.type == "cuda":
            torch.cuda.empty_cache()  # cached but unused blocks are nobody's: counted as free
            start = DeviceMemory.read(device)
        loaded = load_model(spec.model, device, spec.dtype, spec.seed, tp)
        m = loaded.model
        context_len = resolve_max_model_len(spec.max_model_len, m.max_context_len)
        if start is None:
            weights_bytes = module_bytes(m)
        else:
            weights_bytes = DeviceMemory.read(device).allocated - start.allocated
        # the longest pass: a round's budget, or without chunking one prompt of the whole context
        longest_pass = max(spec.prefill_max_tokens, 0 if spec.chunked_prefill else context_len)
        runner = ModelRunner(
            m,
            None,
            get_backend(str(device)),
            device,
            spec.max_batch_size,
            # plus a recomputed last position per fully cached prompt; plus a continuing chunk
            prefill_max_tokens=longest_pass + spec.prefill_max_requests,
            prefill_max_seqs=spec.prefill_max_requests + 1,
            max_context_len=context_len,
            block_size=spec.block_size,
        )
    bytes_per_block = KVStore.bytes_per_block(
        m.num_layers, spec.block_size, m.num_kv_heads, m.head_dim, loaded.dtype
    )
    # Profiling runs the model (its collectives included) on every rank; only the plan that
    # follows can refuse the configuration.
    profiled = runner.profile_memory() if start is not None else None
    with tp.on_every_rank("plan its memory"):
        plan = _plan_memory(runner, start, profiled, weights_bytes, bytes_per_block, spec)
    plan = replace(plan, num_blocks=tp.min_over_ranks(plan.num_blocks))
    kv = KVStore(
        m.num_layers, plan.num_blocks, spec.block_size, m.num_kv_heads, m.head_dim,
        loaded.dtype, device,
    )  # fmt: skip
    runner.bind_kv(kv)
    return BuiltRunner(runner, loaded, plan)


def inline_host_ops(device: torch.device) -> None:
    """In a process of radixinfer's own that drives ``device`` (an engine process, a worker rank),
    run torch's CPU operations on the calling thread, unless ``OMP_NUM_THREADS`` says otherwise; on
    a CPU device, change nothing (there they are the model's forward).

    Why: the host's share of a GPU engine's step is Python and small tensor copies (block tables,
    step inputs), each far too short to split, yet torch splits any of more than ~32,000 elements
    over a pool of a thread per core, whose threads then spin beside the server's API server and
    client processes for the cores. vLLM's engine processes do the same. Call it once the model is
    loaded: loading converts whole weights on the CPU, which the pool speeds up."""
    if device.type != "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _plan_memory(
    runner: ModelRunner,
    start: DeviceMemory | None,
    profiled: ProfiledMemory | None,
    weights_bytes: int,
    bytes_per_block: int,
    spec: RunnerSpec,
) -> MemoryPlan:
    """On CUDA, split the budget around what profiling measured (`plan_gpu_memory`); elsewhere the
    CPU's plan. ``start``: the device's reading before the model was loaded (None on a CPU)."""
    staged_blocks = 0
    if spec.host_cache_gb:
        staged_blocks = write_back_blocks(
            host_blocks_for(spec.host_cache_gb, bytes_per_block), runner.block_size,
            spec.prefill_max_tokens, spec.prefill_max_requests, spec.max_batch_size,
        )  # fmt: skip
    common = {
        "bytes_per_block": bytes_per_block,
        "block_size": runner.block_size,
        "max_model_len": runner.max_context_len,
        "num_blocks": spec.num_blocks,
        "host_staging_bytes": staged_blocks * bytes_per_block,
    }
    if start is None:
        return plan_cpu_memory(weights_bytes=weights_bytes, **common)
    profiled_end = DeviceMemory.read(runner.device)
    return plan_gpu_memory(
        device=str(runner.device),
        total_bytes=start.total,
        free_bytes_at_start=start.free,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        weights_bytes=weights_bytes,
        other_bytes=max(0, profiled_end.used - start.used - weights_bytes),
        profiled=profiled,
        **common,
    )
