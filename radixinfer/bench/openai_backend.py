"""The benchmark against any OpenAI-compatible server (``radixinfer serve``, vLLM, SGLang):
streaming ``/v1/completions`` requests with token-id prompts, measured from the client's side.

A token's timestamp is the client's ``perf_counter`` when the chunk holding it arrived, so TTFT, ITL
and throughput include the server's HTTP path and the network, as a user sees them. Chunks carry
their token ids when the server returns them (``return_token_ids``, which radixinfer and vLLM
honour); otherwise a chunk's ids are its text encoded with the model's tokenizer (exact for one
token a chunk, an estimate for a chunk that merges several). The server's own prefix cache counters
are not read (``cache_stats`` is None): each request's cached prompt tokens come from its usage's
``prompt_tokens_details.cached_tokens`` (radixinfer always sends it; vLLM and SGLang behind a flag),
and the run's hit rate from those when every request reported them; ``--cold-cache`` empties the
server's cache through ``POST /reset_prefix_cache``.

Requests run as coroutines of one client event loop on its own thread, each on a connection of its
own read by `radixinfer.bench.sse_client` (a lean SSE reader: the bench must read faster than the
server under test writes, or it measures itself; ``benchmarks/sse_client_rate.py`` measures it).
Deltas reach the run loop in lists: one list per pass of the client loop, not one queue put per
chunk, so the run loop wakes once per burst. A chunk's tokens are counted from its ``token_ids``
(one chunk may carry several when the server coalesces), never by re-tokenizing its text when
the server sends them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import threading
from typing import Any

import httpx

from radixinfer.bench.sse_client import post_events
from radixinfer.core_messages import StreamEvents, StreamFailure
from radixinfer.models import load_tokenizer
from radixinfer.outputs import StreamDelta
from radixinfer.sampling_params import SamplingParams

DONE = b"[DONE]"  # the payload that ends a stream
_DEFAULTS = SamplingParams()  # fields left at these are not sent


class OpenAIBackend:
    """A server at ``base_url`` running ``model`` (a preset name or local checkpoint dir: its
    tokenizer and config, read here without loading weights, build the same workload as in process).
    The API key, if the server needs one, comes from ``OPENAI_API_KEY``."""

    def __init__(self, base_url: str, model: str) -> None:
        self.tokenizer, config = load_tokenizer(model)
        self.vocab_size: int = config.vocab_size
        headers = {}
        if api_key := os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {api_key}"
        base_url = base_url.rstrip("/")
        base_url = base_url if base_url.endswith("/v1") else f"{base_url}/v1"
        card = (
            httpx.get(f"{base_url}/models", headers=headers, timeout=30).raise_for_status().json()
        )
        card = card["data"][0]
        self.served_model: str = card["id"]
        self.max_context_len: int = card.get("max_model_len") or config.max_position_embeddings
        self.info = {"base_url": base_url, "served_model": self.served_model}
        self._base_url = base_url
        self._headers = headers
        self._ids = itertools.count()
        self._pending: dict[queue.SimpleQueue[StreamEvents], StreamEvents] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="openai-client", daemon=True
        )
        self._thread.start()

    def _on_loop(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def submit(
        self,
        prompt: list[int] | bytes,
        params: SamplingParams,
        sink: queue.SimpleQueue[StreamEvents],
    ) -> str:
        request_id = f"http-{next(self._ids)}"
        self._on_loop(self._request(request_id, prompt, params, sink))
        return request_id

    def native_prompt(self, prompt: list[int]) -> bytes:
        """The prompt as the JSON its requests send: encoded before the clock starts, as the
        in-process backend converts its prompts (1,152 ids: ~50 us a prompt on the client's loop,
        which the server's clock would otherwise count)."""
        return json.dumps(prompt).encode()

    def cache_stats(self) -> None:
        return None

    def reset_cache(self) -> None:
        url = self._base_url.removesuffix("/v1") + "/reset_prefix_cache"
        httpx.post(url, headers=self._headers, timeout=60).raise_for_status()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # ------------------------------------------------------------------ client loop
    def _emit(
        self, sink: queue.SimpleQueue[StreamEvents], event: StreamDelta | StreamFailure
    ) -> None:
        """Queue ``event`` for ``sink``; the first event queued in a pass of the loop schedules the
        flush."""
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.setdefault(sink, []).append(event)

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for sink, events in pending.items():
            sink.put(events)

    async def _request(
        self,
        request_id: str,
        prompt: list[int] | bytes,
        params: SamplingParams,
        sink: queue.SimpleQueue,
    ) -> None:
        try:
            await self._stream(request_id, prompt, params, sink)
        except Exception as exc:  # noqa: BLE001 - every failure reaches the run loop
            self._emit(sink, StreamFailure(request_id, exc))

    async def _stream(
        self,
        request_id: str,
        prompt: list[int] | bytes,
        params: SamplingParams,
        sink: queue.SimpleQueue,
    ) -> None:
        body = {
            "model": self.served_model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": params.ignore_eos,
            "return_token_ids": True,
        }
        if params.top_k:
            body["top_k"] = params.top_k
        for field in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(params, field) != getattr(_DEFAULTS, field):
                body[field] = getattr(params, field)
        if params.seed is not None:
            body["seed"] = params.seed
        ending: StreamDelta | None = None

        def on_data(payload: bytes, now: float) -> None:
            nonlocal ending
            if payload == DONE:
                return
            delta = self._delta(request_id, json.loads(payload), now, ending)
            if delta is None:
                return
            if delta.finished:
                ending = delta  # sent once the usage (cached tokens) has come
            else:
                self._emit(sink, delta)

        url = f"{self._base_url}/completions"
        if not isinstance(prompt, bytes):
            prompt = self.native_prompt(prompt)
        payload = json.dumps(body).encode()[:-1] + b', "prompt": ' + prompt + b"}"
        await post_events(url, payload, self._headers, on_data)
        if ending is None:
            raise RuntimeError("the stream ended without a finish reason")
        self._emit(sink, ending)

    def _delta(
        self, request_id: str, chunk: dict, now: float, ending: StreamDelta | None
    ) -> StreamDelta | None:
        """The delta of one chunk (None: it has no tokens); a usage chunk sets ``ending``'s cached
        tokens (None when the server leaves them out)."""
        if "error" in chunk:
            raise RuntimeError(f"the server failed the request: {chunk['error']}")
        if (usage := chunk.get("usage")) and ending is not None:
            details = usage.get("prompt_tokens_details") or {}
            ending.num_cached_tokens = details.get("cached_tokens")
        delta = None
        for choice in chunk.get("choices", ()):
            text = choice.get("text") or ""
            ids = choice.get("token_ids")
            if ids is None:
                ids = self.tokenizer.encode(text) if text else []
            reason = choice.get("finish_reason")
            if ids or reason is not None:
                delta = StreamDelta(request_id, ids, text, reason is not None, reason, None, now)
        return delta
