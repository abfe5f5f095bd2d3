"""Bounded connections: uvicorn's h11 protocol with a header deadline and a connection cap.

uvicorn arms no timer on a connection until its first response is sent, and any byte a client
sends cancels the keep-alive timer: a client that connects and sends nothing, sends its
headers a byte at a time, or keeps trickling a body after an early answer holds its
connection (a file descriptor, buffers) forever. Here:
- the request line and headers must arrive within `read_timeout_s` of the connection (or, on a
  kept-alive connection, of the request's first byte); past it the client gets a 408 and the
  connection is closed. The body is `BodyLimit`'s (api/limits.py), under the same timeout;
- (an answer sent before the body was read to its end, a 413, already closes the connection:
  h11 will not reuse it);
- beyond `max_connections` open connections, a new one gets a 503 envelope and is closed at
  once (uvicorn's `limit_concurrency` would accept it, hold it until it sent a request, and
  answer in plain text).

uvicorn has no public setting for a header deadline, so this subclasses its private
`H11Protocol`: pyproject.toml pins uvicorn's minor version, and tests/test_connections.py says
what changed if that pin moves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("diffshard")

WARN_EVERY_S = 10.0  # a flood of refusals logs one line per this many seconds


def raw_response(status: int, reason: str, message: str, code: str, headers: dict[str, str]) -> bytes:
    """A whole HTTP/1.1 response with the error envelope, written before h11 has seen a request
    (h11 cannot send a response then), always closing the connection."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "server_error" if status >= 500 else "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    lines = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        f"x-request-id: {secrets.token_hex(8)}",  # as every answer has, though no request was read
        "x-content-type-options: nosniff",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def bounded_protocol(read_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these bounds."""

    class BoundedH11Protocol(_Bounded):
        pass

    BoundedH11Protocol.read_timeout_s = read_timeout_s
    BoundedH11Protocol.max_connections = max_connections
    return BoundedH11Protocol


class _Bounded(H11Protocol):
    read_timeout_s: float = 30.0
    max_connections: int = 512
    _last_warning = 0.0  # class-wide: one warning per WARN_EVERY_S for all refused connections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_bytes = 0  # bytes of the request whose headers are awaited

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._warn_refused()
            message = (
                f"too many connections (DIFFSHARD_MAX_CONNECTIONS={self.max_connections}); retry shortly"
            )
            transport.write(
                raw_response(
                    503, "Service Unavailable", message, "too_many_connections", {"retry-after": "1"}
                )
            )
            transport.close()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._request_bytes += len(data)
            self._arm_header_timer()  # a kept-alive connection's next request starts here
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the body is BodyLimit's
            self._cancel_header_timer()
            self._request_bytes = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, in our envelope (and nosniff, as every
        answer), instead of its plain text."""
        message = f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})"
        self.transport.write(raw_response(400, "Bad Request", message, "invalid_http", {}))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.read_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._request_bytes:  # a request had begun: say why it ends
            message = (
                f"the request headers did not arrive within {self.read_timeout_s:g} s "
                "(DIFFSHARD_READ_TIMEOUT_S)"
            )
            self.transport.write(raw_response(408, "Request Timeout", message, "request_timeout", {}))
        self.transport.close()

    def _warn_refused(self) -> None:
        now = time.monotonic()
        if now - _Bounded._last_warning >= WARN_EVERY_S:
            _Bounded._last_warning = now
            log.warning(
                "refusing connections: %d open (DIFFSHARD_MAX_CONNECTIONS)", len(self.connections) - 1
            )
