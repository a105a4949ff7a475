"""Named random-weight models: the real shapes of public checkpoints (benchmarks without downloads), and
``tiny``, the default, which runs fast on a CPU with the byte tokenizer.

Shapes are written by hand from the public configs. Presets set no dtype: ``dtype="auto"`` picks bfloat16 on
CUDA and float32 elsewhere. They use the byte tokenizer, so their EOS is the byte tokenizer's.
"""

from __future__ import annotations

import copy

from transformers import GPT2Config, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from radixinfer.tokenizer import ByteTokenizer

# What the public checkpoints of one family share; each preset adds its own sizes.
_QWEN = dict(
    vocab_size=151936,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    bos_token_id=151643,
)
_LLAMA3 = dict(
    vocab_size=128256,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    bos_token_id=128000,
    eos_token_id=128001,
)


def _llama3_rope(factor: float) -> dict:
    """Llama 3.1's rotary scaling, stretched by ``factor``."""
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# What Llama 3.1's sizes share (8B, 70B).
_LLAMA31 = dict(_LLAMA3, head_dim=128, rope_scaling=_llama3_rope(8.0), tie_word_embeddings=False)

# name -> (config class, keyword arguments)
_PRESETS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "tiny": (
        LlamaConfig,
        dict(  # ~3.3M params
            vocab_size=ByteTokenizer.vocab_size,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=ByteTokenizer.eos_token_id,
        ),
    ),
    "qwen2.5-0.5b": (
        Qwen2Config,
        dict(  # 494M params
            _QWEN,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            eos_token_id=151643,
        ),
    ),
    "qwen3-0.6b": (
        Qwen3Config,
        dict(  # 596M params
            _QWEN,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            eos_token_id=151645,
        ),
    ),
    "llama-3.2-1b": (
        LlamaConfig,
        dict(  # 1.24B params
            _LLAMA3,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            head_dim=64,
            rope_scaling=_llama3_rope(32.0),
            tie_word_embeddings=True,
        ),
    ),
    "llama-3.1-8b": (
        LlamaConfig,
        dict(_LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32),  # 8.03B
    ),
    "llama-3.1-70b": (
        LlamaConfig,
        dict(  # 70.6B params
            _LLAMA31,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
        ),
    ),
    "gpt2": (
        GPT2Config,
        dict(  # 124M params
            vocab_size=50257,
            n_positions=1024,
            n_embd=768,
            n_layer=12,
            n_head=12,
            bos_token_id=50256,
            eos_token_id=50256,
        ),
    ),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def preset_config(name: str) -> PretrainedConfig:
    """A fresh config for preset ``name`` (configs, and the dicts transformers normalises inside them, are
    mutable, so each call builds a new one from a deep copy)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    config_class, kwargs = _PRESETS[name]
    return config_class(**copy.deepcopy(kwargs))
