"""`LLM`'s arguments checked (``ValueError`` naming the argument): the constructor's options as the
engine's config and the runner's spec, and `LLM.generate`'s prompts and sampling params in the
forms the engine takes."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from transformers import PretrainedConfig

from radixinfer import checks
from radixinfer.engine.admission import AdmissionConfig
from radixinfer.engine.config import EngineConfig
from radixinfer.engine.memory import check_utilization
from radixinfer.engine.runner_setup import RunnerSpec
from radixinfer.sampling_params import SEED_LIMIT, SamplingParams

Prompt = str | list[int] | dict  # text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}


def prompt_of(prompt: Prompt) -> str | list[int]:
    """The text or token ids of a prompt given in any of `Prompt`'s forms (vLLM's dicts included);
    ``ValueError`` naming ``prompt`` for a dict of neither kind (the engine checks the rest)."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    raise ValueError(
        "prompt: a dict prompt must be {'prompt': str} or {'prompt_token_ids': [ids]}, got keys "
        f"{sorted(map(str, prompt))}"
    )


def params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt: ``params`` (or the defaults) for each, or the items of a list of
    as many. Raises ``ValueError`` naming ``sampling_params`` for anything else (the engine checks
    the items)."""
    if params is None or isinstance(params, SamplingParams):
        return [SamplingParams() if params is None else params] * num_prompts
    if not isinstance(params, (list, tuple)):
        raise ValueError(
            "sampling_params must be a SamplingParams or a list of them, got "
            f"{type(params).__name__}"
        )
    if len(params) != num_prompts:
        raise ValueError(
            f"sampling_params: got {len(params)} SamplingParams for {num_prompts} prompts"
        )
    return list(params)


def prompt_text(prompt: Prompt) -> str | None:
    """The prompt's text, when it was given as text."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def engine_options(
    *,
    model: str | os.PathLike | PretrainedConfig,
    device: str,
    dtype: str | torch.dtype,
    block_size: int,
    num_blocks: int | None,
    max_batch_size: int,
    enable_prefix_cache: bool,
    seed: int,
    prefill_max_batch_size: int | None,
    prefill_max_tokens: int,
    prefill_admission_policy: str,
    prefill_admission_lookahead: int,
    prefill_force_fifo_every: int,
    chunked_prefill: bool,
    decode_first: bool,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    max_num_seqs: int | None,
    freeze_gc: bool,
    host_cache_gb: float,
    host_write_through_hits: int | None,
    tensor_parallel_size: int,
) -> tuple[EngineConfig, RunnerSpec, torch.device]:
    """`LLM`'s arguments checked (``ValueError`` naming the argument), as the engine's config, the
    runner's spec (every tensor-parallel rank builds its runner from it) and the device."""
    torch_device = checks.device(device)
    for name, value, low in (
        ("block_size", block_size, 1),
        ("max_batch_size", max_batch_size, 1),
        ("prefill_max_tokens", prefill_max_tokens, 1),
        ("prefill_admission_lookahead", prefill_admission_lookahead, 1),
        ("prefill_force_fifo_every", prefill_force_fifo_every, 0),
        ("tensor_parallel_size", tensor_parallel_size, 1),
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
    if host_cache_gb and tensor_parallel_size > 1:
        raise ValueError("host_cache_gb: the host tier does not run with tensor parallelism yet")
    checks.optional_integer("host_write_through_hits", host_write_through_hits, 0)
    if host_write_through_hits is not None and not host_cache_gb:
        raise ValueError("host_write_through_hits needs a host tier (host_cache_gb > 0)")
    admission = AdmissionConfig(
        policy=prefill_admission_policy,
        max_requests=max_batch_size if prefill_max_batch_size is None else prefill_max_batch_size,
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
    spec = RunnerSpec(
        model=model,
        dtype=dtype,
        seed=seed,
        block_size=block_size,
        num_blocks=num_blocks,
        max_batch_size=max_batch_size,
        prefill_max_tokens=admission.max_tokens,
        prefill_max_requests=admission.max_requests,
        chunked_prefill=chunked_prefill,
        max_model_len=max_model_len,
        gpu_memory_utilization=check_utilization(gpu_memory_utilization),
        host_cache_gb=host_cache_gb,
    )
    return config, spec, torch_device
