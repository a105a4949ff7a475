"""Paged-KV models against transformers' own models on the same weights (fp32, CPU).

Each architecture is built with transformers at a tiny size, given large random weights (so greedy
decoding is decisive), saved as safetensors and loaded back through `load_model`.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    BertConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from radixinfer.attention import AttentionMetadata, ForwardContext
from radixinfer.attention.torch_backend import TorchAttentionBackend
from radixinfer.models import PRESET_NAMES, load_model
from radixinfer.models.loader import checkpoint_files
from radixinfer.models.presets import preset_config
from radixinfer.tokenizer import ByteTokenizer, HFTokenizer

VOCAB = 300  # >= the byte tokenizer's 257 ids, so checkpoints without tokenizer files still load
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=None,
)

ARCHS = {
    "llama3": (
        LlamaForCausalLM,
        LlamaConfig(
            **_SMALL,
            num_key_value_heads=2,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2": (
        Qwen2ForCausalLM,
        Qwen2Config(**_SMALL, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **_SMALL,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "mistral": (
        MistralForCausalLM,
        MistralConfig(
            **_SMALL,
            num_key_value_heads=1,
            sliding_window=None,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "gpt2": (
        GPT2LMHeadModel,
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            eos_token_id=None,
            bos_token_id=None,
        ),
    ),
}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Large random weights: N(0, 0.2) matrices, nonzero biases, norm weights near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(
                noise * 0.2
                if p.dim() >= 2
                else noise * 0.1 + (0.0 if name.endswith("bias") else 1.0)
            )


class KVPool:
    """A zeroed KV pool handing out block tables in shuffled (out-of-order) block order."""

    def __init__(self, model, block_size: int, num_blocks: int = 160, seed: int = 0) -> None:
        shape = (model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.block_size = block_size
        self._free = torch.randperm(
            num_blocks, generator=torch.Generator().manual_seed(seed)
        ).tolist()

    def table(self, num_tokens: int) -> list[int]:
        return [self._free.pop() for _ in range(math.ceil(num_tokens / self.block_size))]


def paged_logits(
    model, pool: KVPool, batch: list[tuple[list[int], list[int], int]]
) -> torch.Tensor:
    """One ragged forward. ``batch``: per sequence (block table, new token ids, cached prefix length).
    Returns the logits of every new token, sequences concatenated: [num_tokens, vocab]."""
    bs = pool.block_size
    positions = [p for _, new, prefix in batch for p in range(prefix, prefix + len(new))]
    tables = [table for table, new, _ in batch for _ in new]
    width = max(len(table) for table, _, _ in batch)
    context_lens = [prefix + len(new) for _, new, prefix in batch]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t, _, _ in batch], dtype=torch.int32
        ),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + [len(new) for _, new, _ in batch], dtype=torch.int32)
        .cumsum(0)
        .int(),
        max_query_len=max(len(new) for _, new, _ in batch),
        max_context_len=max(context_lens),
    )
    ctx = ForwardContext(meta, pool.k, pool.v, TorchAttentionBackend())
    input_ids = torch.tensor([t for _, new, _ in batch for t in new])
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, torch.tensor(positions), ctx))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its sharded safetensors checkpoint)."""
    hf_class, config = ARCHS[request.param]
    torch.manual_seed(0)
    hf = hf_class(config).eval()
    randomize_(hf)
    hf.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="100KB")
    assert len(checkpoint_files(path)) > 1
    return hf, load_model(path, "cpu").model


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_full_prompt(pair, block_size):
    hf, model = pair
    tokens = prompt(21, seed=1)
    pool = KVPool(model, block_size)
    assert_logits_close(
        paged_logits(model, pool, [(pool.table(21), tokens, 0)]), hf_logits(hf, tokens)
    )


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_cached_prefix_then_extend(pair, block_size):
    """The second forward reads the first one's K/V from the cache; the prefix (7) ends mid-block."""
    hf, model = pair
    tokens = prompt(20, seed=2)
    pool = KVPool(model, block_size)
    table = pool.table(len(tokens))
    paged_logits(model, pool, [(table, tokens[:7], 0)])
    assert_logits_close(
        paged_logits(model, pool, [(table, tokens[7:], 7)]), hf_logits(hf, tokens)[7:]
    )


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_ragged_batch(pair, block_size):
    hf, model = pair
    prompts = [prompt(n, seed=n) for n in (5, 19, 11)]
    pool = KVPool(model, block_size)
    logits = paged_logits(model, pool, [(pool.table(len(p)), p, 0) for p in prompts])
    assert_logits_close(logits, torch.cat([hf_logits(hf, p) for p in prompts]))


def test_greedy_decode_matches_generate(pair):
    """Two sequences decode together (one token each per forward) for 8 steps after a batched prefill."""
    hf, model = pair
    prompts = [prompt(6, seed=3), prompt(9, seed=4)]
    pool = KVPool(model, block_size=4)
    tables = [pool.table(len(p) + 8) for p in prompts]
    seqs = [list(p) for p in prompts]
    logits = paged_logits(model, pool, [(t, p, 0) for t, p in zip(tables, prompts)])
    logits = logits[
        torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    ]  # each prompt's last token
    for _ in range(8):
        next_tokens = logits.argmax(-1).tolist()
        batch = [(t, [tok], len(s)) for t, tok, s in zip(tables, next_tokens, seqs)]
        for s, tok in zip(seqs, next_tokens):
            s.append(tok)
        logits = paged_logits(model, pool, batch)
    for p, s in zip(prompts, seqs):
        expected = hf.generate(
            torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )[0].tolist()
        assert s == expected


def test_shape_attributes(pair):
    hf, model = pair
    config = hf.config
    assert (model.num_layers, model.hidden_size, model.vocab_size) == (2, 64, VOCAB)
    assert model.head_dim == (getattr(config, "head_dim", None) or 64 // config.num_attention_heads)
    assert model.max_context_len == 256


def test_sliding_window_caps_context():
    config = MistralConfig(**_SMALL, num_key_value_heads=1, sliding_window=128)
    assert load_model(config, "meta").model.max_context_len == 128


def test_tiny_preset_runs_and_greedy_does_not_collapse():
    loaded = load_model("tiny", "cpu")
    model = loaded.model
    assert isinstance(loaded.tokenizer, ByteTokenizer) and loaded.eos_token_ids == (256,)
    assert (
        loaded.dtype == torch.float32 and 2e6 <= sum(p.numel() for p in model.parameters()) <= 5e6
    )
    tokens = loaded.tokenizer.encode("Hello, radix tree!")
    pool = KVPool(model, block_size=16, num_blocks=8)
    table = pool.table(len(tokens) + 32)
    logits, generated = paged_logits(model, pool, [(table, tokens, 0)])[-1:], []
    for _ in range(32):
        generated.append(int(logits[-1].argmax()))
        logits = paged_logits(
            model, pool, [(table, generated[-1:], len(tokens) + len(generated) - 1)]
        )
    assert len(set(generated)) > 1


def test_random_weights_are_seeded():
    def weights(seed: int) -> torch.Tensor:
        return load_model("tiny", "cpu", seed=seed).model.model.layers[0].mlp.down_proj.weight

    assert torch.equal(weights(0), weights(0)) and not torch.equal(weights(0), weights(1))


@pytest.mark.parametrize(
    "name, params",
    [
        ("gpt2", 124.4e6),
        ("qwen2.5-0.5b", 494.0e6),
        ("qwen3-0.6b", 596.0e6),
        ("llama-3.2-1b", 1235.8e6),
        ("llama-3.1-8b", 8030.3e6),
        ("llama-3.1-70b", 70553.7e6),
    ],
)
def test_real_shape_presets_on_meta(name, params):
    loaded = load_model(name, "meta")
    assert sum(p.numel() for p in loaded.model.parameters()) == pytest.approx(params, rel=1e-3)
    assert loaded.model.max_context_len == preset_config(name).max_position_embeddings


def test_preset_names():
    assert PRESET_NAMES[0] == "tiny" and {
        "qwen2.5-0.5b",
        "qwen3-0.6b",
        "llama-3.2-1b",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "gpt2",
    } <= set(PRESET_NAMES)


def test_explicit_dtype():
    loaded = load_model("tiny", "cpu", dtype="bf16")
    assert (
        loaded.dtype == torch.bfloat16 and next(loaded.model.parameters()).dtype == torch.bfloat16
    )
    assert loaded.model.model.rotary_emb.cos.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", "cpu", dtype="int8")


def test_unknown_model_name():
    with pytest.raises(ValueError, match="no-such-model"):
        load_model("no-such-model", "cpu")


def test_unsupported_architecture():
    with pytest.raises(ValueError, match="bert"):
        load_model(
            BertConfig(
                vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4
            ),
            "cpu",
        )


def test_config_vocab_too_small_for_byte_tokenizer():
    with pytest.raises(ValueError, match="vocab_size"):
        load_model(LlamaConfig(**{**_SMALL, "vocab_size": 100}), "cpu")


def test_checkpoint_with_tokenizer_dtype_and_eos(tmp_path, gpt2_checkpoint_dir):
    """A GPT-2 fp16 checkpoint next to a byte-level BPE tokenizer: HF tokenizer, config dtype, EOS ids."""
    config = GPT2Config(
        n_positions=64, n_embd=32, n_layer=1, n_head=2, eos_token_id=0, bos_token_id=0
    )
    GPT2LMHeadModel(config).to(torch.float16).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt2_checkpoint_dir / name, tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 7]}')
    loaded = load_model(tmp_path, "cpu")
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.dtype == torch.float16 and loaded.eos_token_ids == (0, 7)
    assert next(loaded.model.parameters()).dtype == torch.float16


def test_missing_weight_is_an_error(tmp_path):
    hf_class, config = ARCHS["qwen2"]
    hf_class(config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 weights"):
        load_model(tmp_path, "cpu")


def test_gpt2_gelu_new_runs_as_one_kernel_with_the_same_values():
    from transformers import GPT2Config
    from transformers.activations import NewGELUActivation

    from radixinfer.distributed.group import TensorParallel
    from radixinfer.models.gpt2 import GPT2MLP

    config = GPT2Config(n_embd=8, activation_function="gelu_new")
    act = GPT2MLP(config, TensorParallel.single()).act
    assert not isinstance(act, NewGELUActivation)  # not the seven-op form
    x = torch.linspace(-8, 8, 4001)
    torch.testing.assert_close(act(x), NewGELUActivation()(x), rtol=0, atol=1e-6)
