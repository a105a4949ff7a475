"""User-facing sampling parameters, validated on construction so bad input never reaches the engine."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from radixinfer.checks import flag, integer, optional_integer, real, wrong_type

SEED_LIMIT = 2**64  # seeds are unsigned 64-bit integers
TOP_K_LIMIT = 2**31  # a top-k this large keeps every token of any vocabulary
N_LIMIT = 2**10  # completions per prompt
BIAS_LIMIT = 100.0  # a logit bias is in [-100, 100], as in OpenAI's API


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` is greedy; ``top_k`` of 0 or -1 (vLLM's spelling)
    and ``top_p == 1`` disable those filters; ``seed`` (an unsigned 64-bit integer) makes a request's
    samples independent of the batch it runs in. ``detokenize=False`` streams and returns token ids only
    (``text`` stays empty): a client that consumes ids (a benchmark, a front end that detokenizes
    elsewhere) does not pay the per-token incremental detokenization that otherwise runs on the engine's
    thread (vLLM's option of the same name).

    ``n`` completions share one prefill: the prompt's KV is computed once and forked into ``n``
    sequences; sample ``i`` draws from seed ``seed + i``. ``stop``: strings (one or a list) that end
    a completion when its detokenized text contains one, found across token boundaries; the string is
    left out of the text unless ``include_stop_str_in_output`` (needs ``detokenize``).
    ``logprobs=k``: each generated token's log-probability and the ``k`` most likely alternatives,
    from the model's raw logits (before temperature and filters: vLLM's default ``raw_logprobs``);
    ``prompt_logprobs=k`` the same for every prompt token after the first (such a request computes
    its whole prompt: cached positions have no logits).

    Penalties and filters, with vLLM's meanings: ``repetition_penalty`` (> 0; 1 is off) divides the
    positive logits and multiplies the negative ones of every token seen in the prompt or the output;
    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]; 0 is off) subtract once per token
    present in the output, and once per occurrence; ``min_p`` (in [0, 1]) drops tokens whose
    probability is below ``min_p`` times the most likely one's; ``min_tokens`` (0 to ``max_tokens``)
    forbids EOS and ``stop_token_ids`` until that many tokens are out; ``logit_bias`` maps token ids
    to a bias in [-100, 100] added to their logits. Processing order: ``min_tokens``, ``logit_bias``,
    the penalties, then temperature, ``min_p``, ``top_k``, ``top_p``; greedy requests take the
    argmax of the processed logits.

    Holds after construction: every field has its annotated type (numpy integers and floats become
    Python ones, ``top_k == -1`` becomes 0, ``stop_token_ids`` and ``stop`` tuples, an empty
    ``stop`` None, ``logit_bias`` a dict of int to float). Raises ``ValueError`` naming the field on
    any invalid value. Stop token ids and logit bias ids past the model's vocabulary are refused
    when the request is added (`LLMEngine.add_request`), where the vocabulary is known; so are
    ``logprobs`` and ``prompt_logprobs`` larger than the vocabulary or than 20 (the engine's
    ``MAX_LOGPROBS``), and penalties on more samples ``n`` than the engine's ``max_batch_size``
    (each penalised sample holds a row of token counts).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | None = field(default=None)
    detokenize: bool = True
    n: int = 1
    stop: tuple[str, ...] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        checked = {
            "max_tokens": integer("max_tokens", self.max_tokens, 1),
            "temperature": real("temperature", self.temperature),
            "top_p": real("top_p", self.top_p),
            "top_k": max(integer("top_k", self.top_k, -1, TOP_K_LIMIT), 0),
            "seed": None if self.seed is None else integer("seed", self.seed, 0, SEED_LIMIT),
            "ignore_eos": flag("ignore_eos", self.ignore_eos),
            "stop_token_ids": self._checked_stop_token_ids(),
            "detokenize": flag("detokenize", self.detokenize),
            "n": integer("n", self.n, 1, N_LIMIT),
            "stop": self._checked_stop(),
            "include_stop_str_in_output": flag(
                "include_stop_str_in_output", self.include_stop_str_in_output
            ),
            "logprobs": optional_integer("logprobs", self.logprobs, 0),
            "prompt_logprobs": optional_integer("prompt_logprobs", self.prompt_logprobs, 0),
            "presence_penalty": real("presence_penalty", self.presence_penalty),
            "frequency_penalty": real("frequency_penalty", self.frequency_penalty),
            "repetition_penalty": real("repetition_penalty", self.repetition_penalty),
            "min_p": real("min_p", self.min_p),
            "min_tokens": integer("min_tokens", self.min_tokens, 0),
            "logit_bias": self._checked_logit_bias(),
        }
        if checked["stop"] and not checked["detokenize"]:
            raise ValueError("stop: stop strings need detokenize=True (they match the text)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= checked[name] <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {checked[name]}")
        if checked["repetition_penalty"] <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= checked["min_p"] <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if checked["min_tokens"] > checked["max_tokens"]:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if checked["temperature"] < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < checked["top_p"] <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name, value in checked.items():
            if value is not getattr(self, name):  # most fields come as they stay
                object.__setattr__(self, name, value)
        self._derive()

    def _derive(self) -> None:
        """Set what the engine reads of the params on its hot paths, once, as plain attributes
        (not fields: not compared, not in ``repr``): ``penalized`` (a penalty reads the request's
        token counts), ``processes_logits`` (the logits change before the request samples:
        penalties, bias, ``min_tokens``) and ``argmax_only`` (its token is the argmax of the
        model's logits as they come). A `functools.cached_property` would take a lock on its first
        read, and every request brings its own params."""
        penalized = bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
        )
        processes = penalized or bool(self.logit_bias) or self.min_tokens > 0
        object.__setattr__(self, "penalized", penalized)
        object.__setattr__(self, "processes_logits", processes)
        object.__setattr__(self, "argmax_only", self.temperature == 0.0 and not processes)

    def _checked_stop_token_ids(self) -> tuple[int, ...] | None:
        ids = self.stop_token_ids
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)):
            raise wrong_type("stop_token_ids", "a list of token ids", ids)
        return tuple(integer(f"stop_token_ids[{i}]", token_id, 0) for i, token_id in enumerate(ids))

    def _checked_stop(self) -> tuple[str, ...] | None:
        stop = self.stop
        if stop is None:
            return None
        strings = (stop,) if isinstance(stop, str) else stop
        if not isinstance(strings, (list, tuple)):
            raise wrong_type("stop", "a string or a list of strings", stop)
        for i, string in enumerate(strings):
            if not isinstance(string, str) or not string:
                raise wrong_type(f"stop[{i}]", "a non-empty string", string)
        return tuple(strings) or None

    def _checked_logit_bias(self) -> dict[int, float] | None:
        bias = self.logit_bias
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise wrong_type("logit_bias", "a dict of token id to bias", bias)
        checked = {}
        for token_id, value in bias.items():
            token_id = integer("logit_bias key", token_id, 0)
            value = real(f"logit_bias[{token_id}]", value)
            if not -BIAS_LIMIT <= value <= BIAS_LIMIT:
                raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {value}")
            checked[token_id] = value
        return checked

    def ids_only(self) -> SamplingParams:
        """These params with ``detokenize=False``, not checked again: every check still holds (only
        stop strings need ``detokenize``, and params with stop strings raise ``ValueError`` here).
        A front that decodes the text itself asks the engine for ids; checking all the fields again
        (``dataclasses.replace``) cost as much as building them did, once per request."""
        if self.stop:
            raise ValueError("stop: stop strings need detokenize=True (they match the text)")
        params = copy.copy(self)
        object.__setattr__(params, "detokenize", False)
        return params

    @property
    def needs_engine_text(self) -> bool:
        """Whether the engine itself must decode this request's text: it has text (``detokenize``)
        and the engine reads that text (``stop`` strings match it, ``logprobs`` and
        ``prompt_logprobs`` carry decoded tokens) or streams several samples under one id
        (``n > 1``). Otherwise a front end may stream ids and decode them itself (`AsyncLLM`)."""
        return self.detokenize and (
            self.n > 1
            or bool(self.stop)
            or self.logprobs is not None
            or self.prompt_logprobs is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
