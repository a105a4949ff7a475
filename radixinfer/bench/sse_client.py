"""A lean streaming HTTP/1.1 client for the benchmark: one POST on a connection of its own, its
server-sent events handed to a callback as they arrive.

The benchmark reads hundreds of streams at once in one Python process; through httpx each chunk
costs ~30 us (its connection pool, h11's state machine, async generators), so the client capped what
it could measure near 30,000 chunks per second. Here an `asyncio.Protocol` takes each read from the
socket, undoes the chunked transfer encoding and splits events in a few C-speed byte operations:
every event of one read shares its arrival time, and nothing runs per event but the callback.

Only what an OpenAI-compatible server sends is supported: plain ``http://``, a response with
``Transfer-Encoding: chunked``, a ``Content-Length`` or the connection's end as its body's end,
events separated by a blank line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

# (the payload of an event's ``data:`` line, the read's perf_counter time)
OnData = Callable[[bytes, float], None]


class HTTPStatusError(RuntimeError):
    """The server answered with another status than 200; ``body`` is what it said."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:500].decode(errors='replace')}")
        self.status = status


class _EventStream(asyncio.Protocol):
    def __init__(self, request: bytes, on_data: OnData) -> None:
        self.request = request
        self.on_data = on_data
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.chunked = False
        self.remaining: int | None = None  # Content-Length still to read, if one was given
        self.raw = b""  # bytes not parsed yet: headers, or an incomplete transfer chunk
        self.events = b""  # body bytes not split into events yet
        self.ended = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.raw += data
        if not self.status:
            head, found, rest = self.raw.partition(b"\r\n\r\n")
            if not found:
                return
            self._headers(head)
            self.raw = rest
        body = self._dechunk() if self.chunked else self._take_raw()
        if self.status != 200:
            self.events += body
            if self.ended:
                self._finish(HTTPStatusError(self.status, self.events))
            return
        *complete, self.events = (self.events + body).split(b"\n\n")
        for event in complete:
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    self.on_data(line[5:].strip(), now)
        if self.ended:
            self._finish(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.status and not self.chunked and self.remaining is None:
            self.ended = True  # a body without a length ends with the connection
            self.data_received(b"")
        self._finish(exc or ConnectionError("the server closed the connection mid-response"))

    def _headers(self, head: bytes) -> None:
        status_line, *lines = head.split(b"\r\n")
        self.status = int(status_line.split()[1])
        for line in lines:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding" and value == b"chunked":
                self.chunked = True
            elif name == b"content-length":
                self.remaining = int(value)
        if self.remaining == 0:
            self.ended = True

    def _take_raw(self) -> bytes:
        body, self.raw = self.raw, b""
        if self.remaining is not None:
            self.remaining -= len(body)
            self.ended = self.remaining <= 0
        return body

    def _dechunk(self) -> bytes:
        raw, at, parts = self.raw, 0, []
        while True:
            line_end = raw.find(b"\r\n", at)
            if line_end < 0:
                break
            size = int(raw[at:line_end].split(b";")[0], 16)
            if size == 0:
                self.ended = True
                at = len(raw)
                break
            start = line_end + 2
            if len(raw) < start + size + 2:
                break
            parts.append(raw[start : start + size])
            at = start + size + 2
        self.raw = raw[at:]
        return b"".join(parts)

    def _finish(self, error: BaseException | None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(error)
        self.transport.close()


async def post_events(url: str, body: bytes, headers: dict[str, str], on_data: OnData) -> None:
    """POST ``body`` (JSON) to ``url`` (``http://host:port/path``) on a new connection and call
    ``on_data`` for every event's data line until the response ends. Raises `HTTPStatusError` for
    another status than 200 and ``ConnectionError`` if the connection ends first."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"--base-url: only http://host[:port] is supported, got {url!r}")
    host, port = parts.hostname, parts.port or 80
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Accept: text/event-stream\r\nConnection: close\r\n{extra}\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    stream = _EventStream(request, on_data)
    transport, _ = await loop.create_connection(lambda: stream, host, port)
    try:
        await stream.done
    finally:
        transport.close()
