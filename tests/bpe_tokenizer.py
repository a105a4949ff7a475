"""A small GPT-2-style byte-level BPE tokenizer, trained at test time with the ``tokenizers`` library and
saved as a checkpoint's tokenizer files, so tests of real tokenizers need nothing outside the repository
(the ``bpe_tokenizer_dir`` fixture of ``conftest.py`` builds one per test session)."""

from __future__ import annotations

from pathlib import Path

EOS = "<|endoftext|>"  # id 0: GPT-2's BOS, EOS and UNK, and the only special token
PLAIN_ADDED = ("<pad0>", "<pad1>")  # added tokens that are ordinary text, not special
# Training text: English, code, and multi-byte characters of every UTF-8 length.
CORPUS = (
    "Hello world. Hello there, hello again! Say hello to everyone.",
    "You are a helpful assistant. Answer the question concisely and cite your sources.",
    "The quick brown fox jumps over the lazy dog; 0123456789 [0] [1] [42].",
    "def f(x):\n    return 'héllo €' + x  # a comment\n\nclass A:\n    pass\n",
    "日本語 text, ünïcödé and 😀 emoji; ßé€ ॐ 🚀.",
)


def save_bpe_tokenizer(directory: Path, vocab_size: int = 1024) -> Path:
    """Train on `CORPUS` (at most ``vocab_size`` learned ids; the corpus yields fewer) and write
    ``tokenizer.json`` and ``tokenizer_config.json`` to ``directory``, which transformers' AutoTokenizer
    loads as it loads a GPT-2 checkpoint's: byte-level (every text encodes losslessly), `EOS` at id 0,
    `PLAIN_ADDED` after the learned vocabulary. Deterministic: the same corpus trains the same merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer)
    bpe.add_tokens([AddedToken(token, special=False) for token in PLAIN_ADDED])
    hf = GPT2TokenizerFast(
        tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS, model_max_length=1024
    )
    hf.save_pretrained(directory)
    return directory
