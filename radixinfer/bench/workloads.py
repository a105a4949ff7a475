"""What the benchmark sends: sessions of token ids, and when the first turn of each is submitted.

Every workload is a list of `Session`s. A plain request is a one-turn session; a multi-turn chat is a
session whose turn ``k + 1`` prompt is turn ``k``'s prompt, its answer, then ``follow_ups[k]`` (so a
prefix cache that keeps generated tokens serves all but the new user message). Builders return token
ids, so every backend receives exactly the same prompts.

Fixed prompts reproduce the streaming benchmark radixinfer grew out of, so its command lines replay with
the same prompt lengths: repeats are joined by a space and ``--unique-prompts`` appends ``" [i]"`` (``i``
= request index from 0). A suffix keeps the repeated part shareable; a unique *prefix* would make every
prompt a miss.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from radixinfer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Session:
    """One request, or one conversation: ``prompt`` is its first turn; each later turn appends the previous
    answer and the next ``follow_ups`` entry, sent ``think_times[k]`` seconds after answer ``k`` is
    complete (at once without them). Every turn asks for ``max_tokens`` new tokens."""

    prompt: list[int]
    max_tokens: int
    follow_ups: tuple[list[int], ...] = ()
    think_times: tuple[float, ...] = ()

    @property
    def num_turns(self) -> int:
        return 1 + len(self.follow_ups)

    def next_prompt(self, turn: int, prompt: list[int], answer: list[int]) -> list[int]:
        """The prompt of turn ``turn + 1`` after turn ``turn`` (0-based) got ``answer`` to ``prompt``."""
        return prompt + answer + self.follow_ups[turn]

    def think_time(self, turn: int) -> float:
        """Seconds between the answer to turn ``turn`` and the next turn's submission."""
        return self.think_times[turn] if self.think_times else 0.0


def parse_repeats(text: str) -> list[int]:
    """``"65"`` -> ``[65]``; ``"512,1,1,1"`` -> ``[512, 1, 1, 1]`` (cycled over requests)."""
    try:
        repeats = [int(part) for part in text.split(",")]
    except ValueError:
        repeats = []
    if not repeats or min(repeats) < 1:
        raise ValueError(f"--prompt-repeats must be positive integers, got {text!r}")
    return repeats


def fixed_prompt_texts(
    prompt: str, repeats: Sequence[int], unique: bool, num_requests: int
) -> list[str]:
    """Request ``i`` is ``prompt`` repeated ``repeats[i % len(repeats)]`` times, space-joined, plus
    ``" [i]"`` when ``unique``."""
    texts = []
    for i in range(num_requests):
        text = " ".join([prompt] * repeats[i % len(repeats)])
        texts.append(f"{text} [{i}]" if unique else text)
    return texts


def fixed(
    args: argparse.Namespace, tokenizer: Tokenizer, vocab_size: int, rng: np.random.Generator
) -> list[Session]:
    texts = fixed_prompt_texts(
        args.prompt, parse_repeats(args.prompt_repeats), args.unique_prompts, args.num_requests
    )
    return [Session(tokenizer.encode(text), args.max_new_tokens) for text in texts]


def _lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> list[int]:
    """SGLang's random lengths: uniform in ``[max(1, length * range_ratio), length]``."""
    low = max(1, int(length * range_ratio))
    return rng.integers(low, length + 1, size=n).tolist()


def _token_ids(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    return rng.integers(0, vocab_size, size=n).tolist()


def random_lengths(
    args: argparse.Namespace, tokenizer: Tokenizer, vocab_size: int, rng: np.random.Generator
) -> list[Session]:
    """Random token ids with random input and output lengths (SGLang's ``random`` dataset)."""
    n = args.num_requests
    inputs = _lengths(rng, args.input_len, args.range_ratio, n)
    outputs = _lengths(rng, args.max_new_tokens, args.range_ratio, n)
    return [Session(_token_ids(rng, vocab_size, i), o) for i, o in zip(inputs, outputs)]


def shared_prefix(
    args: argparse.Namespace, tokenizer: Tokenizer, vocab_size: int, rng: np.random.Generator
) -> list[Session]:
    """SGLang's generated-shared-prefix shape: ``num_groups`` random system prompts, each followed by
    ``prompts_per_group`` random questions; requests are shuffled so groups interleave in arrival order."""
    sessions = []
    for _ in range(args.num_groups):
        system = _token_ids(rng, vocab_size, args.system_prompt_len)
        for _ in range(args.prompts_per_group):
            sessions.append(
                Session(
                    system + _token_ids(rng, vocab_size, args.question_len), args.max_new_tokens
                )
            )
    return [sessions[i] for i in rng.permutation(len(sessions))]


def multi_turn(
    args: argparse.Namespace, tokenizer: Tokenizer, vocab_size: int, rng: np.random.Generator
) -> list[Session]:
    """``num_conversations`` chats of ``turns`` turns: an ``input_len`` first message, then ``turn_len``
    new user tokens per turn, each turn sent once the previous answer has arrived, after a think time
    drawn from an exponential of mean ``think_time`` seconds (none when 0: at once). The think times
    are drawn after every token, so a conversation's tokens do not depend on them."""
    sessions = [
        Session(
            _token_ids(rng, vocab_size, args.input_len),
            args.max_new_tokens,
            tuple(_token_ids(rng, vocab_size, args.turn_len) for _ in range(args.turns - 1)),
        )
        for _ in range(args.num_conversations)
    ]
    if args.think_time > 0:
        think = rng.exponential(args.think_time, size=(len(sessions), args.turns - 1))
        sessions = [replace(s, think_times=tuple(t.tolist())) for s, t in zip(sessions, think)]
    return sessions


WORKLOADS: dict[
    str, Callable[[argparse.Namespace, Tokenizer, int, np.random.Generator], list[Session]]
] = {
    "fixed": fixed,
    "random": random_lengths,
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
}


def build_workload(
    args: argparse.Namespace, tokenizer: Tokenizer, vocab_size: int
) -> list[Session]:
    """The sessions of ``args.dataset``, deterministic in ``args.seed`` (every backend gets the same)."""
    return WORKLOADS[args.dataset](args, tokenizer, vocab_size, np.random.default_rng(args.seed))


def arrival_offsets(
    num: int, request_rate: float, submit_interval_ms: float | None, rng: np.random.Generator
) -> list[float]:
    """Seconds after the start at which each session's first turn is submitted: every
    ``submit_interval_ms`` when given, else a Poisson process of ``request_rate`` per second (the first at
    0), or all at once when the rate is infinite."""
    if submit_interval_ms is not None:
        return [i * submit_interval_ms / 1e3 for i in range(num)]
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = rng.exponential(1.0 / request_rate, size=num)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


def fit_to_context(prompt: list[int], max_context_len: int, truncate: bool) -> list[int]:
    """``prompt``, left-truncated to the model context when ``truncate`` (the end of a prompt is what the
    answer depends on); otherwise a too-long prompt raises ValueError as the API would."""
    if len(prompt) <= max_context_len:
        return prompt
    if truncate:
        return prompt[-max_context_len:]
    raise ValueError(
        f"prompt has {len(prompt)} tokens, longer than the model's context of {max_context_len}; "
        "pass --truncate-prompts to left-truncate prompts to the context"
    )
