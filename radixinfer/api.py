"""The public API (DESIGN §8): `LLM` with `generate`, `stream`, `cache_stats` and `reset_prefix_cache`."""

from __future__ import annotations

import atexit
import gc
import logging
import os
from collections.abc import Hashable, Iterator, Sequence

import torch
from transformers import PretrainedConfig

from radixinfer.attention import get_backend
from radixinfer.cache.kv_manager import KVCacheManager
from radixinfer.cache.kv_store import KVStore
from radixinfer.engine.admission import AdmissionConfig
from radixinfer.engine.engine import EngineConfig, LLMEngine
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
from radixinfer.sampling_params import SamplingParams

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
        device=str(runner.device), total_bytes=start.total, free_bytes_at_start=start.free,
        gpu_memory_utilization=gpu_memory_utilization, weights_bytes=weights_bytes,
        other_bytes=max(0, profiled_end.used - start.used - weights_bytes),
        profiled=profiled,
        **common,
    )


class LLM:
    """An inference engine over one model, with a token-level radix-tree prefix cache.

    ``model`` is a preset name (``"tiny"``, ``"qwen2.5-0.5b"``, ...), a local HF checkpoint dir, or a
    transformers ``PretrainedConfig`` (random weights). Engine options beyond the fixed signature
    (``prefill_max_batch_size``, ``prefill_max_tokens``, ``prefill_admission_policy``,
    ``prefill_admission_lookahead``, ``prefill_force_fifo_every``, ``chunked_prefill``, ``decode_first``,
    ``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``) are keyword-only.
    ``max_batch_size`` caps the sequences decoded per step; ``max_num_seqs`` (default: KV memory)
    caps the requests holding KV at once.

    Memory (`radixinfer.engine.memory`): on CUDA the engine may use ``gpu_memory_utilization`` of
    the whole GPU (vLLM's meaning; two engines in one process take a share each). Weights, the
    worst-case step's activations and the CUDA graphs are measured at start-up and the KV pool gets
    the rest, unless ``num_blocks`` fixes it (it must still fit). ``max_model_len`` (default: the
    model's context) caps prompt plus output and the workspaces sized by it. A configuration that
    cannot fit raises ``ValueError`` saying what to lower. The plan is logged and kept in
    ``memory_plan``. On a CPU the pool is ``num_blocks`` or 256 MiB of blocks.
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
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        admission = AdmissionConfig(
            policy=prefill_admission_policy,
            max_requests=prefill_max_batch_size or max_batch_size,
            max_tokens=prefill_max_tokens,
            chunked_prefill=chunked_prefill,
            lookahead=prefill_admission_lookahead,
            force_fifo_every=prefill_force_fifo_every,
        )
        config = EngineConfig(
            max_batch_size=max_batch_size, max_num_seqs=max_num_seqs, admission=admission, decode_first=decode_first,
            seed=seed,
        )
        check_utilization(gpu_memory_utilization)
        if num_blocks is not None and (
            isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1
        ):
            raise ValueError(f"num_blocks must be a positive integer or None, got {num_blocks!r}")
        torch_device = torch.device(device)
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
            m, None, get_backend(str(torch_device)), torch_device, max_batch_size,
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
            runner, start, weights_bytes, bytes_per_block, gpu_memory_utilization, num_blocks)
        blocks = self.memory_plan.num_blocks
        runner.bind_kv(
            KVStore(
                m.num_layers, blocks, block_size, m.num_kv_heads, m.head_dim, loaded.dtype,
                torch_device,
            )
        )
        logger.info("%s", self.memory_plan.summary())
        cache = KVCacheManager(blocks, block_size, enable_prefix_cache)
        self.tokenizer = loaded.tokenizer
        self.engine = LLMEngine(runner, cache, loaded.tokenizer, loaded.eos_token_ids, config)
        # Everything alive now (torch, transformers, the model's modules, the graphs) lives as long as the
        # engine: freezing it keeps the collector's full passes, which stop the engine loop, from rescanning
        # hundreds of thousands of objects that can never be garbage.
        # (Unfrozen at exit, so interpreter shutdown still finalises them.)
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)

    def _add_all(
        self, prompts: Sequence[Prompt], params: Sequence[SamplingParams], cache_salt: Hashable
    ) -> list[str]:
        """Enqueue every prompt or none: a bad one aborts those already added, then re-raises."""
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(prompt, p, cache_salt))
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
                self.engine.pop_finished(request_id)
            raise
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: Hashable = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (batched) and return one output per prompt, in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        params = params if params is not None else SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = self._add_all(prompts, per_prompt, cache_salt)
        engine = self.engine
        while any(engine.requests[i].finish_reason is None for i in ids):
            engine.step()
        return [self._output(engine.pop_finished(i)) for i in ids]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, cache_salt: Hashable = None
    ) -> Iterator[StreamDelta]:
        """Yield this prompt's new tokens as they are produced (the engine keeps serving other requests).
        Closing the iterator early aborts the request."""
        (request_id,) = self._add_all([prompt], [params or SamplingParams()], cache_salt)
        engine = self.engine
        finished = False
        try:
            while not finished:
                for delta in deltas_of(engine.step()):
                    if delta.request_id == request_id:
                        finished = delta.finished
                        yield delta
        finally:
            if not finished:
                engine.abort(request_id)
            engine.pop_finished(request_id)

    @staticmethod
    def _output(req) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids.tolist(),
            token_ids=req.output_ids,
            text=req.text,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            finish_reason=req.finish_reason,
        )

    def cache_stats(self) -> dict[str, float | int]:
        return self.engine.cache_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()
