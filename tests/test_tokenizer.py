"""Byte tokenizer, transformers wrapper, and incremental detokenization (deltas + flush == decode)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixinfer.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer

# multi-byte characters of every UTF-8 length, plus ASCII and whitespace
TEXT = st.text(alphabet=st.sampled_from(list("ab ,.\n") + list("éß€日本語😀🚀ॐ")), max_size=40)


@pytest.fixture(scope="module")
def bpe_hf(gpt2_checkpoint_dir):
    """The GPT-2-small comparison checkpoint's kind of tokenizer: byte-level BPE, 50,257 ids."""
    return AutoTokenizer.from_pretrained(gpt2_checkpoint_dir)  # ~4 s: load once


@pytest.fixture(scope="module")
def bpe(bpe_hf) -> HFTokenizer:
    return HFTokenizer(bpe_hf)


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Every delta, one per id, then the flush."""
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.add(i) for i in ids] + [detok.flush()]


class DecodeSpy:
    """Wraps a tokenizer and records the longest id sequence ``decode`` was asked for."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.longest = inner, 0
        self.vocab_size, self.eos_token_id = inner.vocab_size, inner.eos_token_id

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, ids):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids)

    def is_special(self, token_id):
        return self.inner.is_special(token_id)


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 257 and tok.eos_token_id == 256
    ids = tok.encode("héllo €")
    assert ids == list("héllo €".encode()) and tok.decode(ids) == "héllo €"
    assert tok.decode([104, 256, 105, 70000]) == "hi"  # EOS and ids past the vocab render nothing
    assert tok.decode([0xE2, 0x82]) == "\ufffd"
    assert tok.is_special(256) and tok.is_special(-1) and not tok.is_special(255)


def test_hf_tokenizer_wraps_a_byte_level_bpe(bpe):
    assert isinstance(bpe, Tokenizer) and bpe.vocab_size == 50257 and bpe.eos_token_id == 0
    text = "def f(x):\n    return 'héllo €'"
    ids = bpe.encode(text)
    assert 0 not in ids and bpe.decode(ids) == text  # no BOS/EOS added; lossless
    assert bpe.decode([0] + ids + [0]) == text  # special tokens are dropped
    assert (
        bpe.is_special(0) and bpe.is_special(50257) and not bpe.is_special(8192)
    )  # <pad0> is plain text


def test_hf_tokenizer_adds_bos_only_when_the_tokenizer_does(bpe_hf):
    bpe_hf.add_bos_token = True
    try:
        tok = HFTokenizer(bpe_hf)
        expected = [bpe_hf.bos_token_id] + bpe_hf.encode("a b", add_special_tokens=False)
        assert tok.encode("a b") == bpe_hf("a b")["input_ids"] == expected
    finally:
        bpe_hf.add_bos_token = False


def test_detokenizer_holds_back_split_characters():
    assert stream(ByteTokenizer(), list("a€".encode())) == ["a", "", "", "€", ""]


def test_detokenizer_flushes_an_unfinished_character():
    assert "".join(stream(ByteTokenizer(), [0x61, 0xE2, 0x82])) == "a\ufffd"


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_detokenizer_matches_decode_on_text(bpe, text):
    for tok in (ByteTokenizer(), bpe):
        ids = tok.encode(text)
        assert "".join(stream(tok, ids)) == tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=50300), max_size=30))
def test_detokenizer_matches_decode_on_arbitrary_ids(bpe, ids):
    """Any ids a random model may emit: invalid UTF-8, specials, ids past the vocab."""
    byte_ids = [i % 300 for i in ids]
    assert "".join(stream(ByteTokenizer(), byte_ids)) == ByteTokenizer().decode(byte_ids)
    assert "".join(stream(bpe, ids)) == bpe.decode(ids)


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=50300), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=6),
)
def test_detokenizer_fed_in_groups_matches_decode(bpe, ids, cuts):
    """``add_many`` over any grouping of the ids (a stream taking several steps' tokens at once)
    gives the same text as decoding them all."""
    bounds = [0, *sorted(min(c, len(ids)) for c in cuts), len(ids)]
    for tok, tok_ids in ((ByteTokenizer(), [i % 300 for i in ids]), (bpe, ids)):
        detok = IncrementalDetokenizer(tok)
        text = [detok.add_many(tok_ids[a:b]) for a, b in zip(bounds, bounds[1:])]
        assert "".join(text) + detok.flush() == tok.decode(tok_ids)


@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_detokenizer_decodes_a_small_window(name, bpe):
    """O(1) per token: a long stream, with ids the tokenizer drops mixed in, never decodes more than a few ids."""
    spy = DecodeSpy(bpe if name == "bpe" else ByteTokenizer())
    ids = spy.encode("日本語 text, ünïcödé and 😀 emoji. " * 40)
    ids = [x for i in ids for x in (i, 99999)]  # an id past every vocab after each token
    assert "".join(stream(spy, ids)) == spy.decode(ids)
    spy.longest = 0
    stream(spy, ids)
    assert spy.longest <= 8
