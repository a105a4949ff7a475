"""Checking a prompt: `PromptChecker` turns what a caller passes into the token-id array a request
keeps, or raises ``ValueError`` naming what is wrong."""

from __future__ import annotations

import array
from dataclasses import dataclass

import numpy as np

from radixinfer.tokenizer import Tokenizer


@dataclass(frozen=True)
class PromptChecker:
    """What checking a prompt needs and nothing more: the tokenizer, the vocabulary size and the
    context length. It holds no engine state and pickles, so a front in another process than its
    engine checks prompts where they arrive."""

    tokenizer: Tokenizer
    vocab_size: int
    max_context_len: int

    def token_ids(self, prompt: str | list[int] | np.ndarray) -> np.ndarray:
        """The prompt's token ids, checked, as the int64 array a request keeps
        (`Request.token_array`): converted once here, where checking the ids needs an array anyway.
        ``array("q", ids)`` converts at C speed and refuses what is not an integer (a float, a
        string) instead of truncating it. Raises ``ValueError``.

        For token ids it reads nothing that changes, so any thread may call it: `AsyncLLM.submit`
        converts them on the submitting thread and hands the engine the array (~30 us for 1,000
        ids, that the engine loop would otherwise spend before planning a step). A string is encoded
        with the tokenizer on the calling thread."""
        if isinstance(prompt, str):
            try:
                prompt.encode()
            except UnicodeEncodeError as exc:  # lone surrogates: no tokenizer can encode them
                raise ValueError(
                    f"prompt is not valid Unicode text: {exc.reason} at index {exc.start}"
                ) from None
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
            if ids and isinstance(ids[0], bool):  # a mask passed as a prompt: bools are ints
                raise ValueError("prompt: token ids must be integers, got bools")
        elif isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
                raise ValueError(
                    f"prompt: an array of token ids must be 1-D integers, got {prompt.ndim}-D "
                    f"{prompt.dtype}"
                )
            ids = prompt
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if len(ids) == 0:
            raise ValueError("prompt must not be empty")
        if len(ids) > self.max_context_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, longer than the model's context of "
                f"{self.max_context_len}"
            )
        if isinstance(ids, np.ndarray):
            token_ids = ids
        else:
            try:
                token_ids = np.frombuffer(array.array("q", ids), dtype=np.int64)
            except TypeError:
                raise ValueError("prompt: token ids must be integers") from None
            except OverflowError:
                raise ValueError(
                    f"prompt: a token id is outside the vocabulary [0, {self.vocab_size})"
                ) from None
        if not (0 <= token_ids.min() and token_ids.max() < self.vocab_size):
            bad = int(token_ids[(token_ids < 0) | (token_ids >= self.vocab_size)][0])
            raise ValueError(
                f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        if token_ids is not ids:
            return token_ids
        if ids.dtype == np.int64 and isinstance(ids.base, bytes):
            # over immutable bytes, as a prompt arrives through an engine process's pipe
            # (`radixinfer.core_messages.AddRequest`): nothing can change it, so it is kept as is
            return ids
        return ids.astype(np.int64)  # the caller's array, which the caller may change: copied
