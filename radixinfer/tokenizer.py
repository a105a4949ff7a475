"""Tokenizers: the interface the engine uses, a built-in byte tokenizer, a transformers wrapper, and
incremental detokenization for streaming.

Every tokenizer decodes with special tokens dropped, so an EOS at the end of a generation adds no text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

_REPLACEMENT_CHAR = (
    "\ufffd"  # what UTF-8 decoding with errors="replace" shows for an incomplete sequence
)


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens (and ids outside the vocabulary) dropped."""
        ...

    def is_special(self, token_id: int) -> bool:
        """True when ``decode`` drops this id: special tokens and ids outside the vocabulary."""
        ...


class ByteTokenizer:
    """Ids ``0..255`` are the UTF-8 bytes of the text; ``256`` is EOS. No BOS.

    Decoding drops every id outside ``0..255`` (EOS, and ids a model with a larger vocabulary may emit) and
    replaces invalid UTF-8 with U+FFFD, so any id sequence decodes without error.
    """

    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        try:  # the common case, every id a byte: one C call (the streaming detokenizer decodes twice per token)
            raw = bytes(ids)
        except ValueError:
            raw = bytes(i for i in ids if 0 <= i < 256)
        return raw.decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return not 0 <= token_id < 256


class HFTokenizer:
    """A transformers tokenizer behind the `Tokenizer` interface.

    ``encode`` prepends BOS exactly when ``tokenizer(text)`` would (``add_bos_token`` / the post-processor
    of a Llama-style tokenizer) and never appends EOS or any other special token: a prompt is the start of a
    text, not a finished one. ``vocab_size`` counts added tokens too (``len(tokenizer)``).
    """

    def __init__(self, hf_tokenizer) -> None:
        self._tok = hf_tokenizer
        self.vocab_size: int = len(hf_tokenizer)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        bos = hf_tokenizer.bos_token_id
        with_specials = hf_tokenizer.encode("a", add_special_tokens=True)
        plain = hf_tokenizer.encode("a", add_special_tokens=False)
        adds_bos = bos is not None and len(with_specials) > len(plain) and with_specials[0] == bos
        self._bos_prefix: list[int] = [bos] if adds_bos else []
        # the ids decode(skip_special_tokens=True) drops: special added tokens plus the named special tokens
        self._special_ids = frozenset(hf_tokenizer.all_special_ids) | {
            i for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special
        }

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
        """Load the tokenizer files of a local checkpoint dir (offline)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(os.fspath(path)))

    def encode(self, text: str) -> list[int]:
        return self._bos_prefix + self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids or not 0 <= token_id < self.vocab_size

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int] | None:
        """The ids of ``messages`` (``{"role", "content"}`` dicts) rendered by the tokenizer's chat template
        with the assistant's turn opened, or None when it has no template. The template writes its own
        special tokens (BOS included), so none is added."""
        if not self._tok.chat_template:
            return None
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into text deltas for streaming.

    Contract: ``"".join(deltas) + flush() == tokenizer.decode(all_ids)``.

    Decoding every id sequence from the start is O(n) per token. Instead only a window of recent ids is
    decoded (vLLM's prefix/read offsets)::

        ids      ... | a b | c d      a b = prefix window: already emitted, decoded again only as context
                     ^     ^          c d = ids whose text is not emitted yet
        prefix_offset  read_offset

    The text of ``c d`` is ``decode(a b c d)[len(decode(a b)):]``; the context matters for tokenizers that
    drop a leading space at the start of a decode (SentencePiece). While that text ends in U+FFFD, an id
    may have split a multi-byte character, so it is held back until a later id completes it (or until
    ``flush``). Ids that ``decode`` drops never enter the window, so the context is always real text. The
    window is the last emitted ids plus the held ones, a few ids long: each token costs O(1) amortised.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []  # the window: ids[prefix_offset:]; older ids are discarded
        self._read_offset = 0  # within the window

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the text it completes (possibly ``""``)."""
        if self._tokenizer.is_special(token_id):
            return ""
        self._ids.append(token_id)
        return self._decode_window()

    def add_many(self, token_ids: Sequence[int]) -> str:
        """Feed several generated ids at once; returns the text they complete, with one decode
        instead of one per id (a stream that takes several steps' tokens at once)."""
        is_special = self._tokenizer.is_special
        kept = [token_id for token_id in token_ids if not is_special(token_id)]
        if not kept:
            return ""
        self._ids += kept
        return self._decode_window()

    def _decode_window(self) -> str:
        new_text = self._tokenizer.decode(self._ids)
        if new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Text still held back (an unfinished character at the end); call once when the sequence ends."""
        return self._emit(self._tokenizer.decode(self._ids))

    def _emit(self, new_text: str) -> str:
        prefix_text = self._tokenizer.decode(self._ids[: self._read_offset])
        del self._ids[: self._read_offset]  # the ids just decoded become the next prefix window
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
