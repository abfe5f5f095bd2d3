"""Refuse request bodies over a byte limit, or slower than the read timeout, before anything
parses them. Routes that take images (edits) have a larger limit of their own, and their body
is not read here: it streams to the route (which bounds each part as it comes, api/multipart.py)
under the same limit and deadline, so a large upload is never held whole. A JSON route that
may carry images (generations with ControlNets served: base64 control images) has a larger
limit too, and is read here whole like any other.

The body is read here, up to the limit, and handed on whole; a body that goes past the
limit (by its Content-Length or as it streams in) is answered 413 at once. A body that has not
arrived in full `read_timeout_s` after its headers is answered 408 and its connection closed:
a client that sends headers and then trickles or stops never holds a connection (and its file
descriptor and buffers) for longer than that. (Headers are bounded by the same timeout in
`connections.py`, before any of this runs.)
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError, envelope

CLOSE = {"connection": "close"}  # the body was not read to its end: the connection cannot be reused


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        read_timeout_s: float = 30.0,
        by_path: dict[str, tuple[int, str]] | None = None,
        whole: dict[str, tuple[int, str]] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.by_path = by_path or {}  # path → (its limit, the settings that make it): streamed to the route
        self.whole = whole or {}  # likewise, but read here whole (a JSON body with images in it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        default = (self.max_bytes, "DIFFSHARD_MAX_BODY_BYTES")
        limit, setting = self.by_path.get(path) or self.whole.get(path) or default
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit, setting)
            return
        if path in self.by_path:
            await self._stream(scope, receive, send, limit, setting)
            return
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body = await self._read(receive, limit)
        except TimeoutError:
            message = (
                f"the request body did not arrive within {self.read_timeout_s:g} s (DIFFSHARD_READ_TIMEOUT_S)"
            )
            await envelope(408, message, code="request_timeout", headers=CLOSE)(scope, receive, send)
            return
        if body is None:
            return  # the client went away mid-body: nobody to answer
        if len(body) > limit:
            await self._refuse(scope, receive, send, limit, setting)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send, limit: int, setting: str) -> None:
        """The app reads the body itself; past the limit or the deadline, its read raises the
        413 or 408 (an APIError, answered by its handler), and any answer sent before the body's
        end closes the connection (h11 cannot reuse it; uvicorn would keep reading it)."""
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        size, done = 0, False

        async def bounded() -> Message:
            nonlocal size, done
            if done:  # the body is in: what follows is the disconnect the route may wait for
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                late = f"the request body did not arrive within {self.read_timeout_s:g} s"
                late += " (DIFFSHARD_READ_TIMEOUT_S)"
                raise APIError(408, late, code="request_timeout", headers=CLOSE) from None
            if message["type"] != "http.request":
                done = True
                return message
            size += len(message.get("body", b""))
            if size > limit:
                too_large = f"the request body is over {limit} bytes ({setting})"
                raise APIError(413, too_large, code="body_too_large", headers=CLOSE)
            done = not message.get("more_body", False)
            return message

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start" and not done:
                MutableHeaders(scope=message)["connection"] = "close"
            await send(message)

        await self.app(scope, bounded, closing)

    async def _read(self, receive: Receive, limit: int) -> bytes | None:
        """The whole body, or its first bytes past the limit; None if the client left."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit or not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int, setting: str) -> None:
        response = envelope(
            413,
            f"the request body is over {limit} bytes ({setting})",
            code="body_too_large",
            headers=CLOSE,
        )
        await response(scope, receive, send)
