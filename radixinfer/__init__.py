"""radixinfer: LLM inference around a token-level radix-tree prefix cache over refcounted paged KV blocks."""

from radixinfer.api import LLM
from radixinfer.async_llm import AsyncLLM
from radixinfer.engine_process import EngineProcess
from radixinfer.outputs import CompletionOutput, Logprob, RequestOutput, StreamDelta
from radixinfer.sampling_params import SamplingParams

__all__ = [
    "AsyncLLM",
    "CompletionOutput",
    "EngineProcess",
    "LLM",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
]
__version__ = "0.1.0"
