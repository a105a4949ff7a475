"""Request intake: checks what a caller submits and builds the engine's `Request` for it. Bad input
raises ``ValueError`` naming the caller's field, before anything is allocated."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Container

import numpy as np

from radixinfer.engine.logprobs import MAX_LOGPROBS
from radixinfer.engine.prompts import PromptChecker
from radixinfer.engine.request import Request, Status
from radixinfer.engine.stop_strings import StopStrings
from radixinfer.sampling_params import SEED_LIMIT, SamplingParams
from radixinfer.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestIntake:
    """Validates prompts and parameters against the model (vocabulary, context), the KV pool
    (``num_blocks`` of ``block_size``) and the sampler's token-count rows (``max_penalized``: a
    penalised request's samples each take one), and numbers requests in arrival order. ``seed``
    draws the sampling seeds of requests that bring none."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        max_context_len: int,
        block_size: int,
        num_blocks: int,
        seed: int,
        max_penalized: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_penalized = max_penalized
        self._arrivals = itertools.count()
        self._seeds = random.Random(seed)  # per-request sampling seeds when params.seed is None
        # what checking a prompt needs; it pickles, so a front in another process checks there
        self.prompts = PromptChecker(tokenizer, vocab_size, max_context_len)

    def request(
        self,
        prompt: str | list[int] | np.ndarray,
        params: SamplingParams,
        cache_salt: str | None,
        request_id: str | None,
        taken: Container[str],
    ) -> Request:
        """A new `Request`, checked. ``cache_salt``: None, or a non-empty string (vLLM's rule);
        ``request_id``: None (numbered by arrival) or a string not in ``taken``. A request of ``n``
        > 1 samples is its first sample, whose ``group`` holds the others (`Request`)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            got = "an empty string" if isinstance(cache_salt, str) else type(cache_salt).__name__
            raise ValueError(f"cache_salt must be a non-empty string or None, got {got}")
        if request_id is not None and not isinstance(request_id, str):
            got = type(request_id).__name__
            raise ValueError(f"request_id must be a string or None, got {got}")
        prompt_array = self.prompts.token_ids(prompt)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.vocab_size
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            bad = max(params.stop_token_ids)
            raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab})")
        asked = params.logprobs is not None or params.prompt_logprobs is not None
        for name in ("logprobs", "prompt_logprobs") if asked else ():
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name}: {k} is more than the vocabulary's {vocab} tokens")
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(
                    f"{name}: {k} is more than the {MAX_LOGPROBS} alternatives per position the "
                    "engine returns"
                )
        if params.logit_bias and max(params.logit_bias) >= vocab:
            bad = max(params.logit_bias)
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.penalized and params.n > self.max_penalized:
            raise ValueError(
                f"n: {params.n} penalised samples need a token-count row each, more than the "
                f"{self.max_penalized} the engine holds (max_batch_size)"
            )
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
        stop_strings = (
            StopStrings(params.stop, params.include_stop_str_in_output) if params.stop else None
        )
        now = time.perf_counter()
        group: list[Request] = []
        for index in range(params.n):
            sample = Request(
                request_id=request_id,
                prompt_ids=prompt_array,
                params=params,
                salt=cache_salt,
                seed=(seed + index) % SEED_LIMIT,  # each sample its own stream
                arrival_index=arrival,
                detokenizer=IncrementalDetokenizer(self.tokenizer) if params.detokenize else None,
                arrival_time=now,
                stop_ids=stop_ids,
                max_output_len=min(params.max_tokens, self.max_context_len - prompt_len),
                status=Status.FORKING if index else Status.WAITING,
                index=index,
                group=group,
                stop_strings=stop_strings,
                logprobs=None if params.logprobs is None else [],
                prompt_logprobs=None if params.prompt_logprobs is None or index else [None],
            )
            group.append(sample)
        return group[0]

    def prompt_ids(self, prompt: str | list[int] | np.ndarray) -> np.ndarray:
        """The prompt's token ids, checked (`PromptChecker.token_ids`). Raises ``ValueError``."""
        return self.prompts.token_ids(prompt)
