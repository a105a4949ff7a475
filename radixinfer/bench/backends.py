"""What the benchmark runs against: a streaming backend that takes token ids and delivers `StreamDelta`s.

The run loop (`radixinfer.bench.run_loop`) is written once against `Backend`; radixinfer and the
transformers baseline (`radixinfer.bench.hf`) differ only here. Every delta's ``timestamp`` must be the
time its token was produced, in ``time.perf_counter`` seconds, so the loop's own queueing never counts.
"""

from __future__ import annotations

import argparse
import queue
from typing import Any, Protocol

import numpy as np

import radixinfer
from radixinfer.api import LLM
from radixinfer.async_llm import AsyncLLM
from radixinfer.core_messages import StreamEvents
from radixinfer.data_parallel import DataParallelLLM, add_stats
from radixinfer.engine.runner_setup import inline_host_ops
from radixinfer.engine_args import llm_kwargs
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import Tokenizer


class Backend(Protocol):
    tokenizer: Tokenizer
    vocab_size: int  # prompts may use ids in [0, vocab_size)
    max_context_len: int  # prompt + generated tokens never exceed it
    info: dict  # recorded beside the metrics: what exactly ran (versions, modes)

    def submit(
        self, prompt: Any, params: SamplingParams, sink: queue.SimpleQueue[StreamEvents]
    ) -> str:
        """Start a request with a prompt of token ids (a list, or what `native_prompt` made of one); its events
        (or a `StreamFailure`) go to ``sink``, in lists (a backend may batch events of many requests into one
        list). Returns its request id."""
        ...

    def native_prompt(self, prompt: list[int]) -> Any:
        """``prompt`` in the form `submit` takes without converting it. The run loop prepares the prompts it
        knows before its clock starts, as a server receives requests already parsed by other threads: a
        burst of 512 prompts of 1,152 ids otherwise spends ~25 ms converting them, under the GIL the engine
        loop needs, before the first step."""
        ...

    def cache_stats(self) -> dict | None:
        """``LLM.cache_stats()``-style counters, or None when the backend keeps none."""
        ...

    def reset_cache(self) -> None:
        """Empty the prefix cache (only called while no request is running)."""
        ...

    def close(self) -> None:
        """Stop serving and release the model and its KV memory."""
        ...


class RadixBackend:
    """radixinfer's `LLM` behind an `AsyncLLM` (the engine steps on its own thread); the run loop is one
    consumer of many requests, so it takes their events through one queue (`AsyncLLM.submit`)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.vocab_size = llm.engine.vocab_size
        self.max_context_len = llm.engine.max_context_len
        self.info = {
            "radixinfer": radixinfer.__version__,
            "kv_blocks": llm.cache_stats()["total_blocks"],
            "memory_plan": llm.memory_plan.as_dict(),
        }
        self._front = AsyncLLM(llm)

    def submit(
        self,
        prompt: list[int] | np.ndarray,
        params: SamplingParams,
        sink: queue.SimpleQueue[StreamEvents],
    ) -> str:
        return self._front.submit(prompt, params, None, sink)

    def native_prompt(self, prompt: list[int]) -> np.ndarray:
        return self.llm.engine.prompt_ids(prompt)

    def cache_stats(self) -> dict:
        return self._front.call(lambda llm: llm.cache_stats()).result()

    def reset_cache(self) -> None:
        self._front.call(lambda llm: llm.reset_prefix_cache()).result()

    def close(self) -> None:
        self._front.close()
        self.llm.close()  # stops its tensor-parallel workers, if any


class DataParallelBackend:
    """A `DataParallelLLM` (replicas in engine processes, or `LLM`s on threads of this process)
    routing by ``policy`` (None: the front's): the run loop takes its events through one queue, as
    `RadixBackend`'s; ``cache_stats`` adds the replicas' up (`add_stats`). Several backends over
    one front (one per policy) run one at a time: each sets the front's policy as it submits."""

    def __init__(self, front: DataParallelLLM, policy: str | None = None) -> None:
        self.front = front
        self.policy = policy or front.policy
        self.tokenizer = front.tokenizer
        self.vocab_size = front.prompts.vocab_size
        self.max_context_len = front.max_context_len
        self.info = {
            "radixinfer": radixinfer.__version__,
            "data_parallel_size": len(front.replicas),
            "router_policy": self.policy,
            "kv_blocks": self.cache_stats()["total_blocks"],
        }

    def submit(
        self, prompt: np.ndarray, params: SamplingParams, sink: queue.SimpleQueue[StreamEvents]
    ) -> str:
        if self.front.policy != self.policy:
            self.front.policy = self.policy
        return self.front.submit(prompt, params, None, sink)

    def native_prompt(self, prompt: list[int]) -> np.ndarray:
        return self.front.prompts.token_ids(prompt)

    def cache_stats(self) -> dict:
        return add_stats([future.result() for future in self.front.call_all(LLM.cache_stats)])

    def reset_cache(self) -> None:
        for future in self.front.call_all(LLM.reset_prefix_cache):
            future.result()

    def close(self) -> None:
        self.front.close()  # idempotent: backends sharing the front may each close it


def open_radixinfer(
    model: str,
    args: argparse.Namespace,
    prefix_cache: bool,
    policy: str,
    gpu_memory_utilization: float | None = None,
    num_blocks: int | None = None,
    host_cache: bool | None = None,
) -> RadixBackend:
    """An `LLM` configured from the bench flags, with ``prefix_cache`` and admission ``policy`` per
    variant, using ``gpu_memory_utilization`` of the GPU and a KV pool of ``num_blocks`` or else
    what that leaves (variants open side by side split the GPU; None: ``--gpu-memory-utilization`` /
    ``--num-blocks``, for a backend alone). ``host_cache``: with the host KV tier of
    ``--host-cache-gb`` or without (None: as the flags say; never without the prefix cache)."""
    kwargs = llm_kwargs(args)
    kwargs.update(model=model, enable_prefix_cache=prefix_cache, prefill_admission_policy=policy)
    if not prefix_cache or host_cache is False:
        kwargs.update(host_cache_gb=0.0, host_write_through_hits=None)
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if num_blocks is not None:
        kwargs["num_blocks"] = num_blocks
    llm = LLM(**kwargs)
    inline_host_ops(llm.engine.runner.device)  # the bench's process is its own, as an engine's
    return RadixBackend(llm)
