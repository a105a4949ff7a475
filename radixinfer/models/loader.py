"""From a config to a model on its device: architecture lookup, construction, and its weights (a local
safetensors checkpoint, or seeded random values)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from radixinfer.models.base import PagedCausalLM
from radixinfer.models.gpt2 import GPT2LMHeadModel
from radixinfer.models.layers import default_weight_loader
from radixinfer.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[PagedCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
}

RANDOM_INIT_STD = (
    0.2  # large enough that a random model's greedy output does not collapse to one token
)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: PretrainedConfig, device: torch.device, dtype: torch.dtype
) -> PagedCausalLM:
    """Construct the model for ``config`` directly on ``device`` in ``dtype`` (no float32 copy on the CPU).

    Parameter values are placeholders until `load_checkpoint_weights` or `init_random_weights` fills them.
    Raises ValueError for an architecture outside `MODEL_CLASSES`.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_CLASSES:
        architectures = getattr(config, "architectures", None)
        raise ValueError(
            f"unsupported architecture: model_type={model_type!r} (architectures={architectures}); "
            f"supported model types: {', '.join(sorted(MODEL_CLASSES))}"
        )
    with torch.device(device), _default_dtype(dtype):
        model = MODEL_CLASSES[model_type](config)
    return model.eval().requires_grad_(False)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint dir: the shards its index names, else ``model.safetensors``, else
    every ``*.safetensors`` (an index keeps stray files such as Mistral's ``consolidated.safetensors`` out)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    single = path / "model.safetensors"
    files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def load_checkpoint_weights(model: PagedCausalLM, path: Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint dir ``path``, tensor by tensor.

    Each tensor is renamed by ``model.map_checkpoint_weight`` and handed to the owning module's
    ``weight_loader`` (fused layers) or `default_weight_loader`. Raises ValueError on a tensor the model has no
    parameter for, or when a parameter (or a shard of a fused one) is missing from the checkpoint.
    """
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    loaded: set[tuple[str, str | None]] = set()
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                mapped = model.map_checkpoint_weight(name, f.get_tensor(name))
                if mapped is None:
                    continue
                param_name, tensor, shard_id = mapped
                if param_name not in params:
                    raise ValueError(
                        f"checkpoint tensor {name!r} ({file.name}) matches no parameter of the model"
                    )
                module_name, _, _ = param_name.rpartition(".")
                loader = getattr(
                    model.get_submodule(module_name), "weight_loader", default_weight_loader
                )
                loader(params[param_name], tensor, shard_id)
                loaded.add((param_name, shard_id))
    expected = {
        (name, shard_id)
        for name in params
        for shard_id in getattr(model.get_submodule(name.rpartition(".")[0]), "shard_ids", (None,))
    }
    if missing := sorted(expected - loaded, key=str):
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {missing[:3]}")


def init_random_weights(model: PagedCausalLM, seed: int) -> None:
    """Seeded random values on the parameters' own device and dtype: matrices ~ N(0, RANDOM_INIT_STD),
    biases 0, norm weights 1. Same seed, device and dtype -> same weights. A no-op on the meta device."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, RANDOM_INIT_STD, generator=generator)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)
