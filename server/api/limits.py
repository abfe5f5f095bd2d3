"""Refuse request bodies over a byte limit, or slower than the read timeout, before anything
parses them. Routes that take images (edits) have a larger limit of their own.

The body is read here, up to the limit, and handed on whole; a body that goes past the
limit (by its Content-Length or as it streams in) is answered 413 at once. A body that has not
arrived in full `read_timeout_s` after its headers is answered 408 and its connection closed:
a client that sends headers and then trickles or stops never holds a connection (and its file
descriptor and buffers) for longer than that. (Headers are bounded by the same timeout in
`connections.py`, before any of this runs.)
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import envelope

CLOSE = {"connection": "close"}  # the body was not read to its end: the connection cannot be reused


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        read_timeout_s: float = 30.0,
        by_path: dict[str, tuple[int, str]] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.by_path = by_path or {}  # path → (its limit, the settings that make it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self.by_path.get(scope["path"], (self.max_bytes, "DIFFSHARD_MAX_BODY_BYTES"))
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit, setting)
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
