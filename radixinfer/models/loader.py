"""From a config to a model on its device: architecture lookup, construction, and its weights (a local
safetensors checkpoint, or seeded random values)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from radixinfer.distributed.group import TensorParallel
from radixinfer.models.base import PagedCausalLM
from radixinfer.models.gpt2 import GPT2LMHeadModel
from radixinfer.models.layers import CheckpointTensor, LoadedTensor, default_weight_loader
from radixinfer.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[PagedCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
}

WeightLoader = Callable[[torch.Tensor, LoadedTensor, str | None], None]

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
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
) -> PagedCausalLM:
    """Construct the model for ``config`` directly on ``device`` in ``dtype`` (no float32 copy on
    the CPU); with ``tp``, this rank's shard of it.

    Parameter values are placeholders until `load_checkpoint_weights` or `init_random_weights` fills them.
    Raises ValueError for an architecture outside `MODEL_CLASSES`, or a config ``tp`` cannot shard.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_CLASSES:
        architectures = getattr(config, "architectures", None)
        raise ValueError(
            f"unsupported architecture: model_type={model_type!r} (architectures={architectures}); "
            f"supported model types: {', '.join(sorted(MODEL_CLASSES))}"
        )
    with torch.device(device), _default_dtype(dtype):
        model = MODEL_CLASSES[model_type](config, tp or TensorParallel.single())
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

    Each tensor is renamed by ``model.map_checkpoint_weight`` and handed, unread, to the owning
    module's ``weight_loader`` (fused and sharded layers) or `default_weight_loader`, which reads
    what the parameter holds: a tensor-parallel rank reads its shard's rows or columns, nothing
    else. Raises ValueError on a tensor the model has no parameter for, or when a parameter (or a
    shard of a fused one) is missing from the checkpoint.
    """
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    loaded: set[tuple[str, str | None]] = set()
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                mapped = model.map_checkpoint_weight(name, CheckpointTensor(f.get_slice(name)))
                if mapped is None:
                    continue
                param_name, tensor, shard_id = mapped
                if param_name not in params:
                    raise ValueError(
                        f"checkpoint tensor {name!r} ({file.name}) matches no parameter of the model"
                    )
                _weight_loader(model, param_name)(params[param_name], tensor, shard_id)
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
    biases 0, norm weights 1. Same seed, device and dtype -> same weights, whatever the model's
    tensor-parallel shard: the values are drawn for the unsharded parameters, in order, and each
    goes through its weight loader as a checkpoint tensor would. A no-op on the meta device."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return
    with torch.device("meta"):
        unsharded = type(model)(model.config, TensorParallel.single())
    params = dict(model.named_parameters())
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in ((n, p.shape) for n, p in unsharded.named_parameters()):
        param = params[name]
        values = torch.empty(shape, dtype=param.dtype, device=device)
        if values.dim() >= 2:
            values.normal_(0.0, RANDOM_INIT_STD, generator=generator)
        elif name.endswith("bias"):
            values.zero_()
        else:
            values.fill_(1.0)
        _weight_loader(model, name)(param, values, None)


def _weight_loader(model: PagedCausalLM, param_name: str) -> WeightLoader:
    """The loader of a parameter: its module's ``weight_loader``, else `default_weight_loader`."""
    module = model.get_submodule(param_name.rpartition(".")[0])
    return getattr(module, "weight_loader", default_weight_loader)
