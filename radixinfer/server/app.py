"""The OpenAI-compatible HTTP app over an `AsyncLLM` (or a `DataParallelLLM`: the same interface
over several engine replicas): routes, errors, authentication, body limit.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (server-sent events with
``"stream": true``, a chunk holding every token its stream received since the previous one, so a
server behind its engine or a slow client gets fewer, larger chunks and loses nothing; else one
JSON body), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (see
`radixinfer.server.metrics`), ``POST /reset_prefix_cache`` (409 while requests hold KV).

Status codes: 400 for a value the engine refuses or an unsupported field (the message names it), 401
for a missing or wrong API key, 404 for another model name, 413 for a body over ``max_body_bytes``,
422 for a body that is not the schema (bad JSON, wrong types, missing fields), 429 when the waiting
queue is full, 503 once the engine loop has died, 504 when a request runs past its timeout before
its first token (a stream that has started ends with an error event instead). A client that goes
away aborts its request: a stream's writer is cancelled by the disconnect, a non-streaming request
races its collection against it.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixinfer.async_llm import AsyncLLM, EngineLoopError, QueueFullError
from radixinfer.async_stream import AsyncStream, RequestTimeoutError
from radixinfer.chat import chat_prompt_ids
from radixinfer.data_parallel import DataParallelLLM
from radixinfer.outputs import StreamDelta
from radixinfer.server.answers import ChatChunks, CompletionChunks, Run, sse
from radixinfer.server.body_limit import BodyLimit
from radixinfer.server.metrics import ServerMetrics
from radixinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    sampling_params,
)

T = TypeVar("T")
R = TypeVar("R", bound=SamplingRequest)

# OpenAI's default for /v1/completions; chat completions default to what the context leaves
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class ServerConfig:
    """``api_key``: when set, ``/v1/*`` and ``/reset_prefix_cache`` need ``Authorization: Bearer
    KEY``. ``cache_salt_header``: when set, a request's cache salt is this header's value (a gateway
    names the tenant) and the body's ``cache_salt`` is ignored. ``stream_interval``: a streamed chunk
    waits for this many tokens (or the end): fewer, larger chunks cost the server less per token."""

    model_name: str
    api_key: str | None = None
    cache_salt_header: str | None = None
    max_body_bytes: int = 4 * 2**20
    stream_interval: int = 1


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or `_ClientGone` (``work`` cancelled) when the client leaves first."""
    work_task = asyncio.ensure_future(work)
    gone_task = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work_task, gone_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise _ClientGone


def _field_of(location: tuple) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``."""
    return ".".join(str(part) for part in location if part != "body") or "body"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(
    llm: AsyncLLM | DataParallelLLM, config: ServerConfig, metrics: ServerMetrics | None = None
) -> FastAPI:
    """The app serving ``llm`` (which the caller opens and closes); ``metrics``: where it records
    and what ``/metrics`` exposes (None: metrics of its own; an API server process among several
    passes its row of the server's shared table)."""
    app = FastAPI(title="radixinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if metrics is None:
        metrics = ServerMetrics()
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        # never the offending input: it may be anything, invalid UTF-8 included
        problems = [f"{_field_of(e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5]]
        return _error(422, "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)  # FastAPI's own, and Starlette's (a 404 route)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return _error(429, str(exc), "rate_limit_error")

    @app.exception_handler(RequestTimeoutError)
    async def _timeout(_: Request, exc: RequestTimeoutError) -> JSONResponse:
        return _error(504, str(exc), "timeout_error")

    @app.exception_handler(EngineLoopError)
    async def _engine_down(_: Request, exc: EngineLoopError) -> JSONResponse:
        return _error(503, str(exc), "server_error")

    async def authorized(request: Request) -> None:
        # A coroutine: FastAPI runs a plain function dependency on its thread pool, a thread handoff
        # per request under the GIL that the event loop is busy with.
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), config.api_key.encode()
        ):
            raise HTTPException(401, "a valid API key is required (Authorization: Bearer KEY)")

    def start(
        request: Request, body: SamplingRequest, prompt: str | list[int], default_max_tokens: int
    ) -> Run:
        if body.model is not None and body.model != config.model_name:
            raise HTTPException(
                404, f"model: {body.model!r} does not exist; this server runs {config.model_name!r}"
            )
        params = sampling_params(body, default_max_tokens)
        salt = body.cache_salt
        if config.cache_salt_header is not None:
            salt = request.headers.get(config.cache_salt_header)
        return Run(llm.add_request(prompt, params, salt), time.perf_counter())

    async def answer(
        request: Request, body: SamplingRequest, run: Run, chunks: CompletionChunks
    ) -> Response:
        """Wait for the first tokens (so errors the engine finds become statuses), then stream or
        collect. A request the engine rejects is not counted in the metrics; one served, timed out
        or abandoned is."""
        handed_over = False
        try:
            first = await _until_disconnect(request, run.stream.next_deltas())
            if body.stream:
                handed_over = True
                return StreamingResponse(
                    _events(body, run, first, chunks), media_type="text/event-stream"
                )
            run.take(first + await _until_disconnect(request, _rest(run.stream)))
            return JSONResponse(chunks.whole(run))
        except _ClientGone:
            run.finish_reason = "abort"
            raise HTTPException(499, "the client closed the request") from None
        except RequestTimeoutError:
            run.finish_reason = "timeout"
            raise
        finally:
            if not handed_over:
                _finish(run)

    def _finish(run: Run) -> None:
        run.stream.close()
        if run.finish_reason is not None:
            prompt_tokens = len(run.stream.prompt_token_ids)
            metrics.record(
                run.finish_reason,
                prompt_tokens,
                run.num_generated(),
                run.stream.step_times,
                run.arrival,
            )

    async def _events(
        body: SamplingRequest, run: Run, first: list[StreamDelta], chunks: CompletionChunks
    ) -> AsyncIterator[str]:
        usage_sent = False
        interval = config.stream_interval
        try:
            if (opening := chunks.opening()) is not None:
                yield sse(opening)
            deltas = first
            while deltas:
                while interval > 1 and not deltas[-1].finished and _num_tokens(deltas) < interval:
                    if not (more := await run.stream.next_deltas()):
                        break
                    deltas += more
                # One write for what one take added (and the usage, after the last): each write
                # crosses the ASGI middleware, the HTTP protocol and a socket send.
                events = [
                    chunks.delta_event(part, run.choices[part.index])
                    for part in run.take(deltas)
                    if part.text or part.finish_reason or (body.return_token_ids and part.token_ids)
                ]
                if run.finish_reason is not None and body.include_usage and not usage_sent:
                    events.append(sse(chunks.usage(run.usage())))
                    usage_sent = True
                if events:
                    yield "".join(events)
                deltas = await run.stream.next_deltas() if run.finish_reason is None else []
            if body.include_usage and not usage_sent:
                yield sse(chunks.usage(run.usage()))
        except (RequestTimeoutError, EngineLoopError) as exc:
            timeout = isinstance(exc, RequestTimeoutError)
            run.finish_reason = "timeout" if timeout else "error"
            error = {"message": str(exc), "type": "server_error", "code": 504 if timeout else 503}
            yield sse({"error": error})
        finally:
            if run.finish_reason is None:
                run.finish_reason = "abort"  # cancelled: the client went away
            _finish(run)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request) -> Response:
        body = _parsed(CompletionRequest, await request.body())
        run = start(request, body, body.single_prompt(), COMPLETION_DEFAULT_MAX_TOKENS)
        return await answer(request, body, run, CompletionChunks(config.model_name, body))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request) -> Response:
        body = _parsed(ChatCompletionRequest, await request.body())
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = chat_prompt_ids(llm.tokenizer, messages)
        run = start(request, body, prompt, llm.max_context_len)
        return await answer(request, body, run, ChatChunks(config.model_name, body))

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        card = {
            "id": config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "radixinfer",
            "max_model_len": llm.max_context_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        await llm.stats()  # raises EngineLoopError (503) once the loop has died
        return Response(status_code=200)

    @app.get("/metrics")
    async def scrape() -> Response:
        snapshot = await llm.stats()
        return Response(metrics.render(snapshot), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache", dependencies=[Depends(authorized)])
    async def reset_prefix_cache() -> Response:
        try:
            await llm.reset_prefix_cache()
        except RuntimeError as exc:
            raise HTTPException(409, f"{exc}; retry once they finish") from None
        return Response(status_code=200)

    return app


def _parsed(schema: type[R], body: bytes) -> R:
    """``body`` (JSON bytes) validated as ``schema``: one pass of pydantic's parser, which builds the
    model straight from the bytes (a prompt of 1,152 token ids: ~3x cheaper than ``json.loads`` and
    validating the dict, which is what a FastAPI body parameter does). Raises
    `RequestValidationError` (422) for bad JSON or a body that is not the schema."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_input=False, include_url=False)) from None


def _num_tokens(deltas: list[StreamDelta]) -> int:
    return sum(len(delta.token_ids) for delta in deltas)


async def _rest(stream: AsyncStream) -> list[StreamDelta]:
    deltas: list[StreamDelta] = []
    while batch := await stream.next_deltas():
        deltas += batch
    return deltas
