"""Byte tokenizer, transformers wrapper, and incremental detokenization (deltas + flush == decode)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixinfer.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer

PEER_TOKENIZER_DIR = "/work/shared/peer-checkpoint"  # GPT-2-style byte-level BPE, 8,192 merges, 50,257 ids

# multi-byte characters of every UTF-8 length, plus ASCII and whitespace
TEXT = st.text(alphabet=st.sampled_from(list("ab ,.\n") + list("éß€日本語😀🚀ॐ")), max_size=40)


@pytest.fixture(scope="module")
def peer_hf():
    return AutoTokenizer.from_pretrained(PEER_TOKENIZER_DIR)  # ~4 s: load once


@pytest.fixture(scope="module")
def peer(peer_hf) -> HFTokenizer:
    return HFTokenizer(peer_hf)


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


def test_hf_tokenizer_wraps_peer_checkpoint(peer):
    assert isinstance(peer, Tokenizer) and peer.vocab_size == 50257 and peer.eos_token_id == 0
    text = "def f(x):\n    return 'héllo €'"
    ids = peer.encode(text)
    assert 0 not in ids and peer.decode(ids) == text  # no BOS/EOS added; lossless
    assert peer.decode([0] + ids + [0]) == text  # special tokens are dropped
    assert peer.is_special(0) and peer.is_special(50257) and not peer.is_special(8192)  # <pad0> is plain text


def test_hf_tokenizer_adds_bos_only_when_the_tokenizer_does(peer_hf):
    peer_hf.add_bos_token = True
    try:
        tok = HFTokenizer(peer_hf)
        expected = [peer_hf.bos_token_id] + peer_hf.encode("a b", add_special_tokens=False)
        assert tok.encode("a b") == peer_hf("a b")["input_ids"] == expected
    finally:
        peer_hf.add_bos_token = False


def test_detokenizer_holds_back_split_characters():
    assert stream(ByteTokenizer(), list("a€".encode())) == ["a", "", "", "€", ""]


def test_detokenizer_flushes_an_unfinished_character():
    assert "".join(stream(ByteTokenizer(), [0x61, 0xE2, 0x82])) == "a\ufffd"


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_detokenizer_matches_decode_on_text(peer, text):
    for tok in (ByteTokenizer(), peer):
        ids = tok.encode(text)
        assert "".join(stream(tok, ids)) == tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=50300), max_size=30))
def test_detokenizer_matches_decode_on_arbitrary_ids(peer, ids):
    """Any ids a random model may emit: invalid UTF-8, specials, ids past the vocab."""
    byte_ids = [i % 300 for i in ids]
    assert "".join(stream(ByteTokenizer(), byte_ids)) == ByteTokenizer().decode(byte_ids)
    assert "".join(stream(peer, ids)) == peer.decode(ids)


@pytest.mark.parametrize("name", ["byte", "peer"])
def test_detokenizer_decodes_a_small_window(name, peer):
    """O(1) per token: a long stream, with ids the tokenizer drops mixed in, never decodes more than a few ids."""
    spy = DecodeSpy(peer if name == "peer" else ByteTokenizer())
    ids = spy.encode("日本語 text, ünïcödé and 😀 emoji. " * 40)
    ids = [x for i in ids for x in (i, 99999)]  # an id past every vocab after each token
    assert "".join(stream(spy, ids)) == spy.decode(ids)
    spy.longest = 0
    stream(spy, ids)
    assert spy.longest <= 8
