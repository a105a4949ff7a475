"""Shared helpers for engine tests: tiny random checkpoints of each supported family, transformers'
own greedy generation as the oracle, and outputs' logprobs as one flat list to compare."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import transformers

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        **TINY,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=24),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=256
    ),
}


def save_tiny_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint dir (safetensors + config.json). Weights are scaled up so greedy outputs
    are diverse instead of one repeated token."""
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return directory


@functools.cache
def hf_model(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation, never stopping early (memoised: many tests share prompts)."""
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens))


@functools.cache
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
            eos_token_id=None,
        )
    return tuple(out[0, len(prompt) :].tolist())


def logprob_table(completions: list) -> list[float]:
    """Every logprob of ``completions`` (`CompletionOutput`s), flattened in a fixed order
    (position, then token id), with the token ids and ranks folded in, to compare with
    ``pytest.approx``."""
    table = []
    for completion in completions:
        for position in completion.logprobs:
            for token, entry in sorted(position.items()):
                table += [float(token), float(entry.rank), entry.logprob]
    return table
