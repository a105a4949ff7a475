"""The public API (docs/api.md): `LLM` with `generate`, `chat`, `stream`, `cache_stats` and
`reset_prefix_cache`."""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import os
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import PretrainedConfig

from radixinfer.cache.kv_manager import KVCacheManager
from radixinfer.chat import chat_prompt_ids, check_messages
from radixinfer.distributed.driver import TensorParallelRunner
from radixinfer.distributed.launch import join_as_worker, start_group
from radixinfer.engine.engine import LLMEngine
from radixinfer.engine.host_kv import HostKVPool, host_blocks_for
from radixinfer.engine.memory import MemoryPlan
from radixinfer.engine.output import request_output
from radixinfer.engine.runner_setup import build_runner
from radixinfer.llm_args import Prompt, engine_options, params_per_prompt, prompt_of, prompt_text
from radixinfer.models import check_shardable
from radixinfer.outputs import RequestOutput, StreamDelta, deltas_of
from radixinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def run_tensor_parallel_rank(**llm_kwargs) -> None:
    """Be one of ranks ``1 .. N - 1`` of an engine that torchrun started (see docs/multi-gpu.md):
    rank 0 runs ``LLM(**llm_kwargs)`` with ``tensor_parallel_size=N``, and every other rank calls
    this with the same arguments. Returns when rank 0 closes its `LLM`."""
    _, spec, torch_device = engine_options(**{**_LLM_DEFAULTS, **llm_kwargs})
    join_as_worker(torch_device, spec)


class LLM:
    """An inference engine over one model, with a token-level radix-tree prefix cache.

    ``model`` is a preset name (``"tiny"``, ``"qwen2.5-0.5b"``, ...), a local HF checkpoint dir, or a
    transformers ``PretrainedConfig`` (random weights). Engine options beyond the fixed signature
    (``prefill_max_batch_size``, ``prefill_max_tokens``, ``prefill_admission_policy``,
    ``prefill_admission_lookahead``, ``prefill_force_fifo_every``, ``chunked_prefill``,
    ``decode_first``, ``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``,
    ``host_cache_gb``, ``host_write_through_hits``, ``freeze_gc``) are keyword-only.
    ``max_batch_size`` caps the sequences decoded per step; ``max_num_seqs`` (default: KV memory)
    caps the requests holding KV at once.

    Memory (`radixinfer.engine.memory`): on CUDA the engine may use ``gpu_memory_utilization`` of
    the whole GPU (vLLM's meaning; two engines in one process take a share each). Weights, the
    worst-case step's activations and the CUDA graphs are measured at start-up and the KV pool gets
    the rest, unless ``num_blocks`` fixes it (it must still fit). ``max_model_len`` (default: the
    model's context) caps prompt plus output and the workspaces sized by it. A configuration that
    cannot fit raises ``ValueError`` saying what to lower. The plan is logged and kept in
    ``memory_plan``. On a CPU the pool is ``num_blocks`` or 256 MiB of blocks.

    ``tensor_parallel_size=N`` shards every layer over N ranks (docs/multi-gpu.md): on one host
    the `LLM` starts ranks 1..N-1 itself, as processes on ``cuda:(i + r)`` for ``device="cuda:i"``
    (gloo ranks on a CPU); under torchrun it is rank 0 of torchrun's ranks. The scheduler and the
    cache live here, on rank 0, which sends every step to the others; `close` stops them. A
    rank that fails makes the next step raise ``TensorParallelError`` instead of hanging.

    ``host_cache_gb`` > 0 (prefix cache on) puts a host-memory tier of that many GiB of KV blocks
    (pinned on CUDA) under the KV pool: prefixes evicted from the pool are written back there and
    loaded back when a prompt reuses them (`radixinfer.cache.host_tier`). 0 (the default): none. Not
    with tensor parallelism yet. ``host_write_through_hits`` k (with a host tier; None, the default:
    off) also copies a prefix there while it is still in the pool once more than k prompts matched
    it, so its eviction later moves nothing.

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
        host_write_through_hits: int | None = None,
        freeze_gc: bool = False,
        tensor_parallel_size: int = 1,
    ) -> None:
        config, spec, torch_device = engine_options(
            model=model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
            max_batch_size=max_batch_size, enable_prefix_cache=enable_prefix_cache, seed=seed,
            prefill_max_batch_size=prefill_max_batch_size, prefill_max_tokens=prefill_max_tokens,
            prefill_admission_policy=prefill_admission_policy,
            prefill_admission_lookahead=prefill_admission_lookahead,
            prefill_force_fifo_every=prefill_force_fifo_every, chunked_prefill=chunked_prefill,
            decode_first=decode_first, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, freeze_gc=freeze_gc, host_cache_gb=host_cache_gb,
            host_write_through_hits=host_write_through_hits, tensor_parallel_size=tensor_parallel_size,
        )  # fmt: skip
        self._close: Callable[[], None] = lambda: None
        if tensor_parallel_size == 1:
            built = build_runner(spec, torch_device)
            runner = built.runner
        else:
            check_shardable(model, tensor_parallel_size)
            group = start_group(tensor_parallel_size, torch_device, spec)
            try:
                built = build_runner(spec, group.device, group.tp)
            except BaseException:
                group.tp.close()
                group.stop_workers()
                raise
            runner = TensorParallelRunner(built.runner, group)
            self._close = weakref.finalize(self, runner.close)
        self.memory_plan: MemoryPlan = built.memory_plan
        logger.info("%s", self.memory_plan.summary())
        loaded = built.loaded
        host_kv = None
        if host_cache_gb:
            blocks = host_blocks_for(host_cache_gb, self.memory_plan.bytes_per_block)
            staged = self.memory_plan.host_staging_bytes // self.memory_plan.bytes_per_block
            host_kv = HostKVPool(blocks, runner.kv.k, staged)
            logger.info("host KV tier: %d blocks (%.2f GiB)", host_kv.num_blocks, host_cache_gb)
        host_blocks = host_kv.num_blocks if host_kv is not None else 0
        cache = KVCacheManager(
            self.memory_plan.num_blocks, block_size, enable_prefix_cache, host_blocks,
            host_write_through_hits,
        )  # fmt: skip
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
                ids.append(self.engine.add_request(prompt_of(prompt), p, cache_salt))
        except ValueError:
            self._abort_all(ids)
            raise
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        *,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (batched) and return one output per prompt, in input order.

        A prompt is text, token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``;
        ``sampling_params`` is one `SamplingParams` for all or a list of one per prompt (``params``
        is its former name). If anything interrupts the call (an exception, ``KeyboardInterrupt``),
        its requests are aborted and their KV blocks freed before it propagates. Streams open on
        this `LLM` keep receiving their tokens while ``generate`` drives the engine."""
        if params is not None:
            if sampling_params is not None:
                raise ValueError("params: give sampling_params or params (its old name), not both")
            sampling_params = params
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        per_prompt = params_per_prompt(sampling_params, len(prompts))
        ids = self._add_all(prompts, per_prompt, cache_salt)
        engine = self.engine
        try:
            done = 0  # ids[:done] have finished (a finished request stays so until popped)
            while done < len(ids):
                if engine.is_finished(ids[done]):
                    done += 1
                else:
                    self._step()
        except BaseException:
            self._abort_all(ids)
            raise
        return [
            request_output(engine.pop_finished(i), prompt_text(prompt))
            for i, prompt in zip(ids, prompts)
        ]

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them:
        each rendered by the tokenizer's chat template with the assistant's turn opened (the
        built-in template of `radixinfer.chat` when the tokenizer has none, as the ``tiny``
        preset's), then generated as `generate` does."""
        conversations = (
            [messages] if messages and isinstance(messages[0], dict) else list(messages or [None])
        )
        prompts = [
            chat_prompt_ids(self.tokenizer, check_messages(conversation))
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, cache_salt)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, cache_salt: str | None = None
    ) -> Iterator[StreamDelta]:
        """Yield this prompt's new tokens as they are produced; the last delta has ``finished`` set.
        With ``n`` > 1 the samples' deltas interleave, each carrying its ``index``; each sample's
        last delta has its ``finish_reason``, and ``finished`` comes once all have ended.

        The request is checked and queued at the call (bad input raises ``ValueError`` here, not at the first
        ``next``). Any number of streams may be open at once and interleaved with each other and with
        `generate`: each receives every token of its request, whoever drives the engine. Closing the
        iterator early, or dropping it, aborts the request and frees its blocks."""
        (request_id,) = self._add_all([prompt], params_per_prompt(params, 1), cache_salt)
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

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done when the `LLM` is
        garbage collected or the interpreter exits). The engine cannot step afterwards."""
        self._close()

    def cache_stats(self) -> dict[str, float | int]:
        return self.engine.cache_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


_LLM_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(LLM.__init__).parameters.items()
    if p.default is not inspect.Parameter.empty
}
