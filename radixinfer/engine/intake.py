"""Request intake: checks what a caller submits and builds the engine's `Request` for it. Bad input
raises ``ValueError`` naming the caller's field, before anything is allocated."""

from __future__ import annotations

import array
import itertools
import random
import time
from collections.abc import Container

import numpy as np

from radixinfer.engine.request import Request
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestIntake:
    """Validates prompts and parameters against the model (vocabulary, context) and the KV pool
    (``num_blocks`` of ``block_size``), and numbers requests in arrival order. ``seed`` draws the
    sampling seeds of requests that bring none."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        max_context_len: int,
        block_size: int,
        num_blocks: int,
        seed: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._arrivals = itertools.count()
        self._seeds = random.Random(seed)  # per-request sampling seeds when params.seed is None

    def request(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams,
        cache_salt: str | None,
        request_id: str | None,
        taken: Container[str],
    ) -> Request:
        """A new `Request`, checked. ``cache_salt``: None, or a non-empty string (vLLM's rule);
        ``request_id``: None (numbered by arrival) or a string not in ``taken``."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            got = "an empty string" if isinstance(cache_salt, str) else type(cache_salt).__name__
            raise ValueError(f"cache_salt must be a non-empty string or None, got {got}")
        if request_id is not None and not isinstance(request_id, str):
            got = type(request_id).__name__
            raise ValueError(f"request_id must be a string or None, got {got}")
        prompt_array = self.prompt_ids(prompt)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.vocab_size
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            bad = max(params.stop_token_ids)
            raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            bad = max(params.logit_bias)
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        prompt_len = len(prompt_array)
        total = min(prompt_len + params.max_tokens, self.max_context_len)
        blocks = -(-total // self.block_size) + 1  # +1: a copy-on-write of the boundary block
        if blocks > self.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) "
                f"needs {blocks} KV blocks, more than the whole pool ({self.num_blocks})"
            )
        arrival = next(self._arrivals)
        if request_id is None:
            request_id = str(arrival)
        elif request_id in taken:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(31)
        stop_ids = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        detokenizer = IncrementalDetokenizer(self.tokenizer) if params.detokenize else None
        return Request(
            request_id=request_id,
            prompt_ids=prompt_array,
            params=params,
            salt=cache_salt,
            seed=seed,
            arrival_index=arrival,
            detokenizer=detokenizer,
            arrival_time=time.perf_counter(),
            stop_ids=stop_ids,
            max_output_len=min(params.max_tokens, self.max_context_len - prompt_len),
        )

    def prompt_ids(self, prompt: str | list[int] | np.ndarray) -> np.ndarray:
        """The prompt's token ids, checked, as the int64 array a request keeps
        (`Request.token_array`): converted once here, where checking the ids needs an array anyway.
        ``array("q", ids)`` converts at C speed and refuses what is not an integer (a float, a
        string) instead of truncating it. Raises ``ValueError``.

        For token ids it reads nothing that changes, so any thread may call it (a server converts
        them on the submitting thread, sparing the engine loop ~30 us per 1,000 ids). A string is
        encoded with the engine's tokenizer, which only the engine's thread uses."""
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
            got = type(prompt).__name__
            raise ValueError(f"prompt must be a string or a list of token ids, got {got}")
        if len(ids) == 0:
            raise ValueError("prompt must not be empty")
        if len(ids) > self.max_context_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, longer than the model's context of "
                f"{self.max_context_len}"
            )
        vocab = self.vocab_size
        if isinstance(ids, np.ndarray):
            token_ids = ids
        else:
            try:
                token_ids = np.frombuffer(array.array("q", ids), dtype=np.int64)
            except TypeError:
                raise ValueError("prompt: token ids must be integers") from None
            except OverflowError:
                raise ValueError(
                    f"prompt: a token id is outside the vocabulary [0, {vocab})"
                ) from None
        if not (0 <= token_ids.min() and token_ids.max() < vocab):
            bad = int(token_ids[(token_ids < 0) | (token_ids >= vocab)][0])
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        # the caller's array is copied
        return ids.astype(np.int64) if token_ids is ids else token_ids
