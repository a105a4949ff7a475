"""How fast ``radixinfer bench --backend openai`` can read streams: its client against a canned
server that answers every completion with ready-made server-sent events as fast as the socket takes
them, so the client is the only thing measured.

    python3 benchmarks/sse_client_rate.py --streams 512 --chunks 128 --tokens-per-chunk 1

The canned server runs in a subprocess (plain asyncio, no HTTP framework): ``/v1/models`` and a
streaming ``/v1/completions`` whose chunks carry ``token_ids`` as ``radixinfer serve`` sends them.
Prints the tokens and chunks per second the client delivered to its sink, from the first submit to
the last event. A bench whose client reads fewer tokens per second than the server under test
produces measures the client, not the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from radixinfer.bench.openai_backend import OpenAIBackend  # noqa: E402
from radixinfer.sampling_params import SamplingParams  # noqa: E402


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def canned_stream(chunks: int, tokens_per_chunk: int) -> bytes:
    """A whole streamed response: headers, ``chunks`` SSE events, the usage, ``[DONE]``."""
    head = {"id": "cmpl-canned", "object": "text_completion", "created": 0, "model": "tiny"}
    body = []
    for i in range(chunks):
        ids = [65 + (i + j) % 26 for j in range(tokens_per_chunk)]
        reason = "length" if i == chunks - 1 else None
        choice = {"index": 0, "text": bytes(ids).decode(), "logprobs": None}
        event = {**head, "choices": [{**choice, "finish_reason": reason, "token_ids": ids}]}
        body.append(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
    usage = {"prompt_tokens": 4, "completion_tokens": chunks * tokens_per_chunk}
    usage["prompt_tokens_details"] = {"cached_tokens": 0}
    body.append(b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n")
    body.append(b"data: [DONE]\n\n")
    headers = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return headers + b"".join(_chunked(event) for event in body) + b"0\r\n\r\n"


async def serve(port: int, response: bytes) -> None:
    card = json.dumps({"data": [{"id": "tiny", "max_model_len": 4096}]}).encode()
    models = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(models % (len(card), card) if head.startswith(b"GET") else response)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def measure(port: int, streams: int, max_tokens: int) -> tuple[int, int, float]:
    """(tokens, chunks, seconds) the client delivered for ``streams`` concurrent requests."""
    backend = OpenAIBackend(f"http://127.0.0.1:{port}", "tiny")
    sink: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    try:
        start = time.perf_counter()
        for _ in range(streams):
            backend.submit([1, 2, 3, 4], params, sink)
        tokens = chunks = finished = 0
        while finished < streams:
            for event in sink.get(timeout=120):
                if not hasattr(event, "token_ids"):
                    raise RuntimeError(f"a stream failed: {event.error}")
                tokens += len(event.token_ids)
                chunks += 1
                finished += event.finished
        return tokens, chunks, time.perf_counter() - start
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=128, help="chunks per stream [128]")
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    response = canned_stream(args.chunks, args.tokens_per_chunk)
    if args.serve is not None:
        asyncio.run(serve(args.serve, response))
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, __file__, "--serve", str(port), "--chunks", str(args.chunks)]
    server = subprocess.Popen([*command, "--tokens-per-chunk", str(args.tokens_per_chunk)])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for _ in range(args.repeats):
            tokens, chunks, seconds = measure(port, args.streams, args.chunks)
            print(
                f"{args.streams} streams x {args.chunks} chunks x {args.tokens_per_chunk} tokens: "
                f"{tokens / seconds:,.0f} tokens/s, {chunks / seconds:,.0f} chunks/s "
                f"({seconds:.2f} s)"
            )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
