"""The server's streaming cost per token, without an engine, a socket or another process: CPU time
the HTTP app (``radixinfer.server.app``) and its streams spend per streamed token and per chunk,
with a consumer k steps behind, on one thread, so it reads the same on a busy machine.

    python3 benchmarks/bench_stream_front.py --streams 512 --tokens 128 --behind 1 2 4 8

The app runs over a front whose engine is this script: ``--streams`` streaming ``/v1/completions``
requests are opened through the ASGI interface (what uvicorn calls; its HTTP parser and socket
writes are not counted), then each engine step is one `TokenBatch` of one token per stream handed
to the event loop's `StreamRouter` as the engine's reader would; every ``behind`` steps the event
loop runs until every stream has written what it had (a server k steps behind its engine). The
last token of each request comes as a finished `StreamDelta`. Prints CPU microseconds per token
and per chunk (server-sent events the app wrote, the usage and ``[DONE]`` left out) over the decode
phase; the intake (parsing 512 bodies) is not timed. The garbage collector is set as ``radixinfer
serve`` sets it (``--gc-threshold`` 50,000, what lives at the start frozen).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from radixinfer.async_stream import StreamFront, StreamRouter  # noqa: E402
from radixinfer.engine.prompts import PromptChecker  # noqa: E402
from radixinfer.models import load_tokenizer  # noqa: E402
from radixinfer.outputs import StreamDelta, TokenBatch  # noqa: E402
from radixinfer.server.app import ServerConfig, build_app  # noqa: E402


class _Front(StreamFront):
    """A front whose requests go nowhere: the script hands their tokens to the router itself."""

    def __init__(self, model: str) -> None:
        tokenizer, config = load_tokenizer(model)
        self.request_timeout = None
        self._open_streams(PromptChecker(tokenizer, config.vocab_size, 4096))
        self._ids = itertools.count()
        self.submitted: list[str] = []

    def submit_checked(self, prompt_ids, params, cache_salt, sink) -> str:
        self.sink = sink
        request_id = f"req-{next(self._ids)}"
        self.submitted.append(request_id)
        return request_id

    def abort(self, request_id: str) -> None:
        pass


async def _request(app, body: bytes, chunks: list[int]) -> None:
    """One POST through the ASGI interface; counts the body parts the app sends."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 1234), "headers": [(b"content-type", b"application/json")],
    }  # fmt: skip
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks[0] += message["body"].count(b"data: {")
        elif message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"HTTP {message['status']}")

    await app(scope, receive, send)


async def measure(model: str, streams: int, tokens: int, behind: int) -> tuple[float, float]:
    """(CPU us per token, CPU us per chunk, tokens per chunk) over the decode phase."""
    front = _Front(model)
    app = build_app(front, ServerConfig(model_name=model))
    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": tokens, "stream": True}
    body.update(ignore_eos=True, return_token_ids=True, stream_options={"include_usage": True})
    raw = json.dumps(body).encode()
    chunks = [0]
    tasks = [asyncio.create_task(_request(app, raw, chunks)) for _ in range(streams)]
    while len(front.submitted) < streams:
        await asyncio.sleep(0)
    router: StreamRouter = front.sink
    ids = list(front.submitted)
    first = [StreamDelta(r, [65], "", False, None, 0, time.perf_counter()) for r in ids]
    router._dispatch(first)  # the prefill's first tokens: each request's answer starts
    for _ in range(50):
        await asyncio.sleep(0)
    gc.collect()  # as `radixinfer serve` runs: what lives on frozen, collections rare
    gc.freeze()
    chunks[0] = 0
    start = time.process_time()
    for step in range(1, tokens - 1):
        token = 65 + step % 26
        batch = TokenBatch(ids, [token] * streams, [0] * streams, time.perf_counter())
        router._dispatch([batch])
        if step % behind == 0:
            for _ in range(3):
                await asyncio.sleep(0)
    last = [StreamDelta(r, [66], "", True, "length", 0, time.perf_counter()) for r in ids]
    router._dispatch(last)
    await asyncio.gather(*tasks)
    seconds = time.process_time() - start
    decoded = streams * (tokens - 1)
    return 1e6 * seconds / decoded, 1e6 * seconds / max(chunks[0], 1), decoded / max(chunks[0], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128, help="per request [128]")
    parser.add_argument("--behind", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gc.set_threshold(50_000, *gc.get_threshold()[1:])  # serve's --gc-threshold default
    print(f"{'behind (steps)':>14} {'us/token':>9} {'us/chunk':>9} {'tokens/chunk':>12}")
    for behind in args.behind:
        runs = [
            asyncio.run(measure(args.model, args.streams, args.tokens, behind))
            for _ in range(args.repeats)
        ]
        per_token, per_chunk, per = min(runs)
        print(f"{behind:>14} {per_token:>9.1f} {per_chunk:>9.1f} {per:>12.2f}")


if __name__ == "__main__":
    main()
