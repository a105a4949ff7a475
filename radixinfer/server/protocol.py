"""The OpenAI request bodies the server accepts, and how one becomes a `SamplingParams`.

Bodies are validated strictly (a string where a number belongs is a 422, not a coercion). Fields the
engine cannot honour yet but that would change the result (``echo``, ``best_of``, tools, ...) are
refused with a 400 naming the field instead of being ignored: `UNSUPPORTED` lists each with the
value that leaves the result unchanged. Fields that change nothing (``user``) and fields unknown to
OpenAI's API are ignored, as OpenAI-compatible servers do. ``ignore_eos``, ``stop_token_ids``,
``top_k``, ``min_p``, ``min_tokens`` and ``repetition_penalty`` are accepted as vLLM accepts them,
with OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``; ``cache_salt`` names
the tenant whose cache a request may share, ``return_token_ids`` (vLLM's extra) adds each choice's
token ids to the response. ``n``, ``stop`` (with vLLM's ``include_stop_str_in_output``) and log-
probabilities (completions: ``logprobs`` = how many alternatives; chat: ``logprobs`` true and
``top_logprobs``) map onto `SamplingParams`; `completion_logprobs` and `chat_logprobs` shape the
answer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixinfer.outputs import Logprob, PositionLogprobs
from radixinfer.sampling_params import SamplingParams

_INT64 = 2**63 - 1  # ints beyond any engine limit are refused by the schema, not carried further
_TokenId = Annotated[int, Field(ge=0, le=_INT64)]


def _absent_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: (
        value is None or any(value == n and type(value) is type(n) for n in neutral)
    )


# field -> whether a value leaves the result as the engine computes it today (None = not given)
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": _absent_or(1),
    "echo": _absent_or(False),
    "suffix": _absent_or(""),
    "use_beam_search": _absent_or(False),
    "tools": lambda value: not value,
    "response_format": lambda value: value is None or value == {"type": "text"},
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share. Every field of `UNSUPPORTED` is declared
    loosely (``Any``) so the refusal names it whatever its type."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=-_INT64, le=_INT64)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(default=0, ge=-1, le=_INT64)  # vLLM's: -1 or 0 disables it
    seed: int | None = Field(default=None, ge=-_INT64, le=_INT64)
    ignore_eos: bool = False
    stop_token_ids: list[_TokenId] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    user: str | None = None
    n: int = Field(default=1, ge=1, le=_INT64)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extra
    min_p: float = 0.0  # vLLM's extra
    min_tokens: int = Field(default=0, ge=0, le=_INT64)  # vLLM's extra
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias
    best_of: Any = None
    echo: Any = None
    suffix: Any = None
    use_beam_search: Any = None
    tools: Any = None
    response_format: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=_INT64)  # alternatives per token

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the body; ``ValueError`` for a batch (one prompt per request)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"prompt: one prompt per request is supported, got {len(prompt)}")
            return prompt[0]
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=-_INT64, le=_INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=_INT64)

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None


def sampling_params(request: SamplingRequest, default_max_tokens: int) -> SamplingParams:
    """The engine's `SamplingParams` for ``request``: ``ValueError`` naming the field for an
    unsupported or invalid value. ``default_max_tokens`` applies when the body gives no limit."""
    for name, neutral in UNSUPPORTED.items():
        if not neutral(getattr(request, name)):
            raise ValueError(
                f"{name}: not supported by this server (got {getattr(request, name)!r})"
            )
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    return SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k, 0),
        seed=request.seed,
        ignore_eos=request.ignore_eos,
        stop_token_ids=request.stop_token_ids,
        n=request.n,
        stop=request.stop,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=request.num_logprobs,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        min_p=request.min_p,
        min_tokens=request.min_tokens,
        logit_bias=_token_biases(request.logit_bias),
    )


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON keys, so strings) with integer ids; the engine
    checks the ids against the vocabulary and the biases' range."""
    if not logit_bias:
        return None
    biases = {}
    for key, bias in logit_bias.items():
        if not key.isdigit():
            raise ValueError(f"logit_bias: a key must be a token id, got {key!r}")
        biases[int(key)] = bias
    return biases


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of a position, best first."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [item for item in ranked if item[1].rank <= k][:k]


def completion_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], k: int, text_offset: int
) -> dict[str, list]:
    """A completion choice's ``logprobs`` (OpenAI's legacy shape) for tokens after ``text_offset``
    characters of the choice's text."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        values.append(chosen.logprob)
        tops.append({(e.decoded_token or ""): e.logprob for _, e in _top(position, k)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], k: int
) -> dict[str, list]:
    """A chat choice's ``logprobs``: ``{"content": [...]}``, one entry per token."""

    def entry(logprob: Logprob) -> dict[str, Any]:
        text = logprob.decoded_token or ""
        return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode())}

    content = []
    for token_id, position in zip(token_ids, positions):
        item = entry(position[token_id])
        item["top_logprobs"] = [entry(e) for _, e in _top(position, k)]
        content.append(item)
    return {"content": content}
