"""An ASGI middleware that refuses request bodies over a size limit with 413, before the app parses
them.

The body is read here and handed to the app in one piece; later ``receive`` calls (a disconnect
listener) go to the server's own ``receive``. A body over the limit (declared by ``Content-Length`` or
found while reading) is read to its end and dropped, up to `DRAIN_FACTOR` times the limit, before the
413 goes out: a server that answers and closes while the client still sends makes the client's kernel
reset the connection, and the client never reads the answer. A body larger still is cut off.
"""

from __future__ import annotations

import json
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]

DRAIN_FACTOR = 16


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = declared is not None and (
            not declared.isdigit() or int(declared) > self.max_bytes
        )
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            too_large = too_large or size > self.max_bytes
            if not too_large:
                chunks.append(chunk)
            if not message.get("more_body", False) or size > DRAIN_FACTOR * self.max_bytes:
                break
        if too_large:
            chunks.clear()
            await self._refuse(send)
            return
        body: list[Message] = [
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]

        async def replay() -> Message:
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        message = f"the request body is over the limit of {self.max_bytes} bytes"
        error = {"error": {"message": message, "type": "invalid_request_error", "code": 413}}
        payload = json.dumps(error).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
