"""``benchmarks/make_gpt2_checkpoint.py`` at a tiny size: the dir it writes loads with radixinfer's
loader and serves, and its tokenizer is the byte-level BPE the benchmarks expect (8,192 trained ids,
padded with plain tokens to GPT-2's 50,257, EOS at id 0)."""

from __future__ import annotations

import json

import torch

from radixinfer import LLM, SamplingParams
from radixinfer.models import load_model
from radixinfer.tokenizer import HFTokenizer


def test_checkpoint_loads_with_its_tokenizer(gpt2_checkpoint_dir):
    loaded = load_model(gpt2_checkpoint_dir, "cpu")
    tokenizer = loaded.tokenizer
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == loaded.model.vocab_size == 50257
    assert tokenizer.eos_token_id == 0 and loaded.eos_token_ids == (0,)
    assert loaded.dtype == torch.float32 and loaded.model.max_context_len == 64
    saved = json.loads((gpt2_checkpoint_dir / "tokenizer.json").read_text())
    assert saved["model"]["type"] == "BPE" and len(saved["model"]["vocab"]) == 8192
    assert saved["pre_tokenizer"]["type"] == "ByteLevel"
    text = "You are a helpful assistant.\n    return x[0]  # é €"
    ids = tokenizer.encode(text)
    assert max(ids) < 8192 and tokenizer.decode(ids) == text  # trained ids only; lossless
    assert tokenizer.decode([8192, 50256]) == "<pad0><pad42064>"  # padding ids are plain text


def test_checkpoint_serves(gpt2_checkpoint_dir):
    llm = LLM(model=str(gpt2_checkpoint_dir), num_blocks=16)
    out = llm.generate(["Hello Hello"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and all(0 <= t < 50257 for t in out.token_ids)


def test_training_text_is_fixed_by_the_seed(checkpoint_script):
    script = checkpoint_script
    first = list(script.generated_corpus(0, 200))
    assert first == list(script.generated_corpus(0, 200))
    assert first != list(script.generated_corpus(1, 200))
    assert len(set(" ".join(first).split())) > 500  # enough distinct words for thousands of merges
