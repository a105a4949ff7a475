"""What the benchmark runs against: a streaming backend that takes token ids and delivers `StreamDelta`s.

The run loop (`radixinfer.bench.runner`) is written once against `Backend`; radixinfer and the
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
from radixinfer.serving import EngineServer, StreamEvents
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import Tokenizer


class Backend(Protocol):
    tokenizer: Tokenizer
    vocab_size: int  # prompts may use ids in [0, vocab_size)
    max_context_len: int  # prompt + generated tokens never exceed it
    info: dict  # recorded beside the metrics: what exactly ran (versions, modes)

    def submit(self, prompt: Any, params: SamplingParams, sink: queue.SimpleQueue[StreamEvents]) -> str:
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
    """radixinfer's `LLM` behind an `EngineServer` (the engine steps on its own thread)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.vocab_size = llm.engine.vocab_size
        self.max_context_len = llm.engine.max_context_len
        self.info = {"radixinfer": radixinfer.__version__, "kv_blocks": llm.cache_stats()["total_blocks"]}
        self._server = EngineServer(llm.engine)

    def submit(self, prompt: list[int] | np.ndarray, params: SamplingParams,
               sink: queue.SimpleQueue[StreamEvents]) -> str:
        return self._server.submit(prompt, params, sink=sink).request_id

    def native_prompt(self, prompt: list[int]) -> np.ndarray:
        return self.llm.engine.prompt_ids(prompt)

    def cache_stats(self) -> dict:
        return self._server.call(lambda _: self.llm.cache_stats()).result()

    def reset_cache(self) -> None:
        self._server.call(lambda _: self.llm.reset_prefix_cache()).result()

    def close(self) -> None:
        self._server.close()


def open_radixinfer(model: str, args: argparse.Namespace, prefix_cache: bool, policy: str,
                    kv_memory_fraction: float | None = None, num_blocks: int | None = None) -> RadixBackend:
    """An `LLM` configured from the bench flags, with ``prefix_cache`` and admission ``policy`` per variant, and
    a KV pool of ``num_blocks`` or else ``kv_memory_fraction`` of free GPU memory (variants open side by side
    share the GPU; None: ``--num-blocks`` / ``--kv-memory-fraction``, for a backend alone)."""
    llm = LLM(
        model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks if num_blocks is None else num_blocks,
        max_batch_size=args.max_batch_size,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_cache=prefix_cache,
        seed=args.seed,
        prefill_max_batch_size=args.prefill_max_batch_size,
        prefill_max_tokens=args.prefill_max_tokens,
        prefill_admission_policy=policy,
        prefill_admission_lookahead=args.prefill_admission_lookahead,
        prefill_force_fifo_every=args.prefill_force_fifo_every,
        chunked_prefill=not args.no_chunked_prefill,
        decode_first=args.decode_first,
        kv_memory_fraction=args.kv_memory_fraction if kv_memory_fraction is None else kv_memory_fraction,
        freeze_gc=True,  # a benchmark is a long-running front end (`LLM`'s docstring)
    )
    return RadixBackend(llm)
