"""Models with paged-KV forward passes, and `load_model`, the one entry point the engine calls.

load_model("tiny", "cpu")                      preset: random weights, byte tokenizer
load_model("/ckpt/Qwen2.5-0.5B", "cuda")       local HF dir: its safetensors weights and its tokenizer
load_model(LlamaConfig(...), "cpu", seed=3)    a config: random weights, byte tokenizer
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from radixinfer.distributed.group import TensorParallel
from radixinfer.models.base import PagedCausalLM
from radixinfer.models.loader import (
    MODEL_CLASSES,
    build_model,
    init_random_weights,
    load_checkpoint_weights,
)
from radixinfer.models.presets import PRESET_NAMES, preset_config
from radixinfer.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "DTYPE_NAMES",
    "MODEL_CLASSES",
    "PRESET_NAMES",
    "LoadedModel",
    "PagedCausalLM",
    "check_shardable",
    "checkpoint_dir",
    "load_model",
    "load_tokenizer",
    "model_config",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
DTYPE_NAMES: tuple[str, ...] = ("auto", *_DTYPES)  # what ``dtype`` may be given as, by name
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what the engine needs beside it.

    ``eos_token_ids``: ids that end a generation, all ``< model.vocab_size``: the tokenizer's EOS, plus for a
    checkpoint with its own tokenizer the ``eos_token_id`` of ``config.json`` and ``generation_config.json``
    (Llama 3 instruct stops on several). ``dtype`` is the dtype of the weights and of the KV cache to allocate.
    """

    model: PagedCausalLM
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype


def load_model(
    model: str | os.PathLike | PretrainedConfig,
    device: str | torch.device,
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """Build ``model`` (a preset name, a local HF checkpoint dir, or a config) on ``device``; with
    ``tp``, this rank's shard of it (a checkpoint rank reads only its shard's slices; random
    weights equal the unsharded model's).

    Presets and configs get random weights seeded by ``seed`` and the byte tokenizer (their vocabulary must
    hold its 257 ids). A checkpoint without tokenizer files gets the byte tokenizer too. ``dtype``: see
    `resolve_dtype`. Raises ValueError for an unknown name, an unsupported architecture or a bad dtype.
    """
    device = torch.device(device)
    config, checkpoint = _resolve(model)
    dtype = resolve_dtype(dtype, config, device)
    net = build_model(config, device, dtype, tp)
    if checkpoint is not None:
        load_checkpoint_weights(net, checkpoint)
    else:
        init_random_weights(net, seed)
    tokenizer = _load_tokenizer(checkpoint, config)
    return LoadedModel(net, tokenizer, _eos_token_ids(tokenizer, checkpoint, config), dtype)


def checkpoint_dir(model: str | os.PathLike) -> Path | None:
    """None when ``model`` names a preset, else its checkpoint directory, which holds a ``config.json``.
    Raises ``ValueError`` naming ``model`` for anything else (listing the presets)."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(
            "model must be a preset name, a checkpoint directory or a PretrainedConfig, "
            f"got {type(model).__name__}"
        )
    if str(model) in PRESET_NAMES:
        return None
    path = Path(model)
    if not path.is_dir():
        raise ValueError(
            f"model={str(model)!r} is neither a preset ({', '.join(PRESET_NAMES)}) "
            "nor a local checkpoint directory"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model={str(model)!r}: the directory has no config.json, so it is not an HF checkpoint"
        )
    return path


def model_config(model: str | os.PathLike | PretrainedConfig) -> PretrainedConfig:
    """The config `load_model` would build ``model`` from (ValueError as `load_model` gives)."""
    return _resolve(model)[0]


def check_shardable(model: str | os.PathLike | PretrainedConfig, tensor_parallel_size: int) -> None:
    """``ValueError`` naming ``tensor_parallel_size`` when ``model``'s heads or MLP cannot be split
    over that many ranks (its shard is built on the meta device: nothing is allocated or read)."""
    config = model_config(model)
    tp = TensorParallel(0, tensor_parallel_size)
    build_model(config, torch.device("meta"), torch.float32, tp)


def load_tokenizer(model: str | os.PathLike) -> tuple[Tokenizer, PretrainedConfig]:
    """The tokenizer and config `load_model` would use for ``model``, without building the model (a client
    that talks to a server running it)."""
    config, checkpoint = _resolve(model)
    return _load_tokenizer(checkpoint, config), config


def _resolve(model: str | os.PathLike | PretrainedConfig) -> tuple[PretrainedConfig, Path | None]:
    """``model``'s config, and its checkpoint dir when it is one (see `checkpoint_dir`)."""
    if isinstance(model, PretrainedConfig):
        return model, None
    checkpoint = checkpoint_dir(model)
    if checkpoint is None:
        return preset_config(str(model)), None
    try:
        return AutoConfig.from_pretrained(checkpoint), checkpoint
    except (OSError, ValueError) as exc:  # unreadable JSON, no or an unknown model_type
        raise ValueError(f"model={str(model)!r}: its config.json cannot be read: {exc}") from None


def resolve_dtype(
    dtype: str | torch.dtype, config: PretrainedConfig, device: torch.device
) -> torch.dtype:
    """``"auto"``: the config's ``dtype`` (``torch_dtype`` in older transformers) when it has one, as a
    checkpoint's does; else bfloat16 on CUDA and float32 elsewhere. Otherwise a torch floating dtype or its
    name (``"bfloat16"``, ``"bf16"``, ``"float16"``, ``"fp16"``, ``"float32"``, ...)."""
    if isinstance(dtype, str) and dtype == "auto":
        configured = (
            config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        )
        if configured is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        dtype = configured
    resolved = _DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if resolved not in set(_DTYPES.values()):
        raise ValueError(
            f"dtype={dtype!r} is not supported; use 'auto' or one of {', '.join(_DTYPES)}"
        )
    return resolved


def _load_tokenizer(checkpoint: Path | None, config: PretrainedConfig) -> Tokenizer:
    if checkpoint is not None and any((checkpoint / name).is_file() for name in _TOKENIZER_FILES):
        return HFTokenizer.from_pretrained(checkpoint)
    if config.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"vocab_size={config.vocab_size} is too small for the built-in byte tokenizer "
            f"({ByteTokenizer.vocab_size} ids); give a checkpoint with tokenizer files"
        )
    if checkpoint is not None:
        logger.warning("no tokenizer files in %s: using the byte tokenizer", checkpoint)
    return ByteTokenizer()


def _eos_token_ids(
    tokenizer: Tokenizer, checkpoint: Path | None, config: PretrainedConfig
) -> tuple[int, ...]:
    """The config's EOS ids describe the checkpoint's own tokenizer; with the byte tokenizer they are
    meaningless (a random config's ``eos_token_id=2`` is byte 0x02), so only its EOS counts then."""
    ids = [tokenizer.eos_token_id]
    if isinstance(tokenizer, HFTokenizer):
        generation_config = checkpoint / "generation_config.json"
        generation = (
            json.loads(generation_config.read_text()) if generation_config.is_file() else {}
        )
        ids += _as_list(config.eos_token_id) + _as_list(generation.get("eos_token_id"))
    return tuple(dict.fromkeys(i for i in ids if i is not None and 0 <= i < config.vocab_size))


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
