"""The public API (docs/api.md): `LLM` with `generate`, `stream`, `cache_stats` and `reset_prefix_cache`."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import weakref
from collections import deque
from collections.abc import Iterator, Sequence

import torch
from transformers import PretrainedConfig

from radixinfer import checks
from radixinfer.attention import get_backend
from radixinfer.cache.kv_manager import KVCacheManager
from radixinfer.engine.admission import AdmissionConfig
from radixinfer.engine.engine import EngineConfig, LLMEngine
from radixinfer.engine.host_kv import HostKVPool, host_blocks_for
from radixinfer.engine.kv_store import KVStore
from radixinfer.engine.memory import (
    DeviceMemory,
    MemoryPlan,
    check_utilization,
    module_bytes,
    plan_cpu_memory,
    plan_gpu_memory,
    resolve_max_model_len,
)
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.models import load_model
from radixinfer.outputs import RequestOutput, StreamDelta, deltas_of
from radixinfer.sampling_params import SEED_LIMIT, SamplingParams

Prompt = str | list[int]

logger = logging.getLogger(__name__)


def _plan_memory(
    runner: ModelRunner,
    start: DeviceMemory | None,
    weights_bytes: int,
    bytes_per_block: int,
    gpu_memory_utilization: float,
    num_blocks: int | None,
) -> MemoryPlan:
    """On CUDA, profile the runner and split the budget (`plan_gpu_memory`); elsewhere the CPU's
    plan. ``start``: the device's reading before the model was loaded (None on a CPU)."""
    common = {
        "bytes_per_block": bytes_per_block,
        "block_size": runner.block_size,
        "max_model_len": runner.max_context_len,
        "num_blocks": num_blocks,
    }
    if start is None:
        return plan_cpu_memory(weights_bytes=weights_bytes, **common)
    profiled = runner.profile_memory()
    profiled_end = DeviceMemory.read(runner.device)
    return plan_gpu_memory(
        device=str(runner.device),
        total_bytes=start.total,
        free_bytes_at_start=start.free,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights_bytes,
        other_bytes=max(0, profiled_end.used - start.used - weights_bytes),
        profiled=profiled,
        **common,
    )


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt: ``params`` (or the defaults) for each, or the items of a list of
    as many. Raises ``ValueError`` naming ``params`` for anything else (the engine checks the items)."""
    if params is None or isinstance(params, SamplingParams):
        return [SamplingParams() if params is None else params] * num_prompts
    if not isinstance(params, (list, tuple)):
        raise ValueError(
            f"params must be a SamplingParams or a list of them, got {type(params).__name__}"
        )
    if len(params) != num_prompts:
        raise ValueError(f"params: got {len(params)} SamplingParams for {num_prompts} prompts")
    return list(params)


class LLM:
    """An inference engine over one model, with a token-level radix-tree prefix cache.

    ``model`` is a preset name (``"tiny"``, ``"qwen2.5-0.5b"``, ...), a local HF checkpoint dir, or a
    transformers ``PretrainedConfig`` (random weights). Engine options beyond the fixed signature
    (``prefill_max_batch_size``, ``prefill_max_tokens``, ``prefill_admission_policy``,
    ``prefill_admission_lookahead``, ``prefill_force_fifo_every``, ``chunked_prefill``,
    ``decode_first``, ``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``,
    ``host_cache_gb``, ``freeze_gc``) are keyword-only. ``max_batch_size`` caps the sequences
    decoded per step; ``max_num_seqs`` (default: KV memory) caps the requests holding KV at once.

    Memory (`radixinfer.engine.memory`): on CUDA the engine may use ``gpu_memory_utilization`` of
    the whole GPU (vLLM's meaning; two engines in one process take a share each). Weights, the
    worst-case step's activations and the CUDA graphs are measured at start-up and the KV pool gets
    the rest, unless ``num_blocks`` fixes it (it must still fit). ``max_model_len`` (default: the
    model's context) caps prompt plus output and the workspaces sized by it. A configuration that
    cannot fit raises ``ValueError`` saying what to lower. The plan is logged and kept in
    ``memory_plan``. On a CPU the pool is ``num_blocks`` or 256 MiB of blocks.

    ``host_cache_gb`` > 0 (prefix cache on) puts a host-memory tier of that many GiB of KV blocks
    (pinned on CUDA) under the KV pool: prefixes evicted from the pool are written back there and
    loaded back when a prompt reuses them (`radixinfer.cache.host_tier`). 0 (the default): none.

    ``freeze_gc=True`` is for long-running front ends (a server, a benchmark): everything alive
    once the engine is built (torch, transformers, the model's modules, the graphs) lives as long
    as the engine, so it is moved out of the garbage collector's reach (`gc.freeze`), and the
    collector's full passes, which stop the engine loop, stop rescanning hundreds of thousands of
    objects that can never be garbage. It freezes the whole process's objects (unfrozen at exit,
    so interpreter shutdown still finalises them): leave it off in a library or a notebook.
    """

    def __init__(
        self,
        model: str | os.PathLike | PretrainedConfig = "tiny",
        device: str = "cpu",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_size: int = 64,
        enable_prefix_cache: bool = True,
        seed: int = 0,
        *,
        prefill_max_batch_size: int | None = None,
        prefill_max_tokens: int = 8192,
        prefill_admission_policy: str = "fifo",
        prefill_admission_lookahead: int = 64,
        prefill_force_fifo_every: int = 0,
        chunked_prefill: bool = True,
        decode_first: bool = False,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        host_cache_gb: float = 0.0,
        freeze_gc: bool = False,
    ) -> None:
        # Checked here, under the names the caller used (the configs below name their own fields).
        torch_device = checks.device(device)
        for name, value, low in (
            ("block_size", block_size, 1),
            ("max_batch_size", max_batch_size, 1),
            ("prefill_max_tokens", prefill_max_tokens, 1),
            ("prefill_admission_lookahead", prefill_admission_lookahead, 1),
            ("prefill_force_fifo_every", prefill_force_fifo_every, 0),
        ):
            checks.integer(name, value, low)
        for name, value in (
            ("prefill_max_batch_size", prefill_max_batch_size),
            ("max_num_seqs", max_num_seqs),
        ):
            checks.optional_integer(name, value, 1)
        for name, value in (
            ("enable_prefix_cache", enable_prefix_cache),
            ("chunked_prefill", chunked_prefill),
            ("decode_first", decode_first),
            ("freeze_gc", freeze_gc),
        ):
            checks.flag(name, value)
        checks.integer("seed", seed, 0, SEED_LIMIT)
        checks.optional_integer("num_blocks", num_blocks, 1)
        if checks.real("host_cache_gb", host_cache_gb) < 0:
            raise ValueError(f"host_cache_gb must be >= 0, got {host_cache_gb}")
        if host_cache_gb and not enable_prefix_cache:
            raise ValueError("host_cache_gb needs enable_prefix_cache=True (it holds cached KV)")
        admission = AdmissionConfig(
            policy=prefill_admission_policy,
            max_requests=max_batch_size
            if prefill_max_batch_size is None
            else prefill_max_batch_size,
            max_tokens=prefill_max_tokens,
            chunked_prefill=chunked_prefill,
            lookahead=prefill_admission_lookahead,
            force_fifo_every=prefill_force_fifo_every,
        )
        config = EngineConfig(
            max_batch_size=max_batch_size,
            max_num_seqs=max_num_seqs,
            admission=admission,
            decode_first=decode_first,
            seed=seed,
        )
        check_utilization(gpu_memory_utilization)
        start = None
        if torch_device.type == "cuda":
            torch.cuda.empty_cache()  # cached but unused blocks are nobody's: counted as free
            start = DeviceMemory.read(torch_device)
        loaded = load_model(model, torch_device, dtype, seed)
        m = loaded.model
        context_len = resolve_max_model_len(max_model_len, m.max_context_len)
        if start is None:
            weights_bytes = module_bytes(m)
        else:
            weights_bytes = DeviceMemory.read(torch_device).allocated - start.allocated
        # the longest pass: a round's budget, or without chunking one prompt of the whole context
        longest_pass = max(admission.max_tokens, 0 if chunked_prefill else context_len)
        runner = ModelRunner(
            m,
            None,
            get_backend(str(torch_device)),
            torch_device,
            max_batch_size,
            # plus a recomputed last position per fully cached prompt; plus a continuing chunk
            prefill_max_tokens=longest_pass + admission.max_requests,
            prefill_max_seqs=admission.max_requests + 1,
            max_context_len=context_len,
            block_size=block_size,
        )
        bytes_per_block = KVStore.bytes_per_block(
            m.num_layers, block_size, m.num_kv_heads, m.head_dim, loaded.dtype
        )
        self.memory_plan: MemoryPlan = _plan_memory(
            runner, start, weights_bytes, bytes_per_block, gpu_memory_utilization, num_blocks
        )
        blocks = self.memory_plan.num_blocks
        runner.bind_kv(
            KVStore(
                m.num_layers,
                blocks,
                block_size,
                m.num_kv_heads,
                m.head_dim,
                loaded.dtype,
                torch_device,
            )
        )
        logger.info("%s", self.memory_plan.summary())
        host_kv = None
        if host_cache_gb:
            host_kv = HostKVPool(host_blocks_for(host_cache_gb, bytes_per_block), runner.kv.k)
            logger.info("host KV tier: %d blocks (%.2f GiB)", host_kv.num_blocks, host_cache_gb)
        host_blocks = host_kv.num_blocks if host_kv is not None else 0
        cache = KVCacheManager(blocks, block_size, enable_prefix_cache, host_blocks)
        self.tokenizer = loaded.tokenizer
        self.engine = LLMEngine(
            runner, cache, loaded.tokenizer, loaded.eos_token_ids, config, host_kv
        )
        self._streams: dict[
            str, deque[StreamDelta]
        ] = {}  # open `stream` iterators' undelivered deltas
        if freeze_gc:
            gc.collect()
            gc.freeze()
            atexit.register(gc.unfreeze)

    def _add_all(
        self, prompts: Sequence[Prompt], params: Sequence[SamplingParams], cache_salt: str | None
    ) -> list[str]:
        """Enqueue every prompt or none: a bad one aborts those already added, then re-raises."""
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(prompt, p, cache_salt))
        except ValueError:
            self._abort_all(ids)
            raise
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (batched) and return one output per prompt, in input order.

        If anything interrupts the call (an exception, ``KeyboardInterrupt``), its requests are aborted and
        their KV blocks freed before it propagates. Streams open on this `LLM` keep receiving their tokens
        while ``generate`` drives the engine."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        ids = self._add_all(prompts, _params_per_prompt(params, len(prompts)), cache_salt)
        requests = self.engine.requests
        try:
            while any(requests[i].finish_reason is None for i in ids):
                self._step()
        except BaseException:
            self._abort_all(ids)
            raise
        return [self._output(self.engine.pop_finished(i)) for i in ids]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, cache_salt: str | None = None
    ) -> Iterator[StreamDelta]:
        """Yield this prompt's new tokens as they are produced; the last delta has ``finished`` set.

        The request is checked and queued at the call (bad input raises ``ValueError`` here, not at the first
        ``next``). Any number of streams may be open at once and interleaved with each other and with
        `generate`: each receives every token of its request, whoever drives the engine. Closing the
        iterator early, or dropping it, aborts the request and frees its blocks."""
        (request_id,) = self._add_all([prompt], _params_per_prompt(params, 1), cache_salt)
        inbox = self._streams[request_id] = deque()
        deltas = self._deltas(request_id, inbox)
        # A generator dropped before its first `next` never runs its `finally`: abort from a finalizer then.
        weakref.finalize(deltas, self._abort_all, [request_id]).atexit = False
        return deltas

    def _deltas(self, request_id: str, inbox: deque[StreamDelta]) -> Iterator[StreamDelta]:
        finished = False
        try:
            while not finished:
                while not inbox:
                    self._step()
                delta = inbox.popleft()
                finished = delta.finished
                yield delta
        finally:
            # Idempotent: the finalizer set in `stream` may run this cleanup too.
            self._abort_all([request_id])

    def _step(self) -> None:
        """One engine step; its deltas for open streams go to their inboxes."""
        events = self.engine.step()
        streams = self._streams
        if streams:
            for delta in deltas_of(events):
                inbox = streams.get(delta.request_id)
                if inbox is not None:
                    inbox.append(delta)

    def _abort_all(self, request_ids: Sequence[str]) -> None:
        """Abort and forget these requests (any that already finished are forgotten too)."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)
            if request_id in self.engine.requests:
                self.engine.abort(request_id)
                self.engine.pop_finished(request_id)

    @staticmethod
    def _output(req) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids.tolist(),
            token_ids=req.output_ids,
            text=req.text,
            num_cached_tokens=req.num_cached_tokens or 0,
            finish_reason=req.finish_reason,
        )

    def cache_stats(self) -> dict[str, float | int]:
        return self.engine.cache_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()
