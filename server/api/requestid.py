"""Request ids, and the last word on errors nothing else answered.

Every request gets an id: the client's `x-request-id` when it is short and plain (so a proxy's
or a client's id carries through), else one made here. It comes back on every response and is
in the log lines about the request, so a client quoting the id of a 500 leads an operator to
the details that were kept out of the answer. An exception no handler took is logged here with
that id and answered 500 with fixed text: a client never sees internals. Every answer also says
`X-Content-Type-Options: nosniff`: a browser never reads a JSON error echoing client text as HTML.
"""

from __future__ import annotations

import logging
import re
import secrets
from contextvars import ContextVar

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import envelope, internal_message

log = logging.getLogger("diffshard")

HEADER = "x-request-id"
# What a client's id may be: UUIDs, hex, ULIDs, dotted or colon-joined tokens. Anything else
# (long, spaces, control characters, quotes) could forge or break log lines: a fresh id replaces it.
ACCEPTED = re.compile(r"[A-Za-z0-9._:-]{1,64}")

_current: ContextVar[str | None] = ContextVar("diffshard_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request this task serves (None outside a request)."""
    return _current.get()


def accepted_id(value: bytes | None) -> str | None:
    """The client's id if it is one we keep, else None."""
    text = value.decode("latin-1") if value else ""
    return text if ACCEPTED.fullmatch(text) else None


class RequestContext:
    """ASGI middleware, outermost: gives each request its id (scope state, a context variable for
    log lines), puts it on every response, and answers 500 for an unhandled exception."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == HEADER.encode()), None)
        rid = accepted_id(given) or secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = rid
        token = _current.set(rid)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers[HEADER] = rid
                headers.setdefault("x-content-type-options", "nosniff")  # no answer is sniffed as HTML
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as err:
            log.error(
                "request %s: internal error on %s %s",
                rid,
                scope["method"],
                scope["path"],
                exc_info=err,
                extra={"request_id": rid},
            )
            if started:  # the answer is half sent: uvicorn closes the connection
                raise
            response = envelope(500, internal_message("internal server error", rid), code="internal_error")
            await response(scope, receive, send_with_id)
        finally:
            _current.reset(token)


class RequestIdFilter(logging.Filter):
    """For a log handler: lines logged while serving a request (uvicorn's access line, warnings)
    end with the request's id, unless they name it already (`extra={"request_id": ...}`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = _current.get()
        if rid is not None and not hasattr(record, "request_id"):
            record.msg, record.args = f"{record.getMessage()} [request {rid}]", None
            record.request_id = rid
        return True


REDACTED = "?[query not logged]"


class QueryRedaction(logging.Filter):
    """For uvicorn's access logger: its line shows the path without the query string. A client
    may send a key as `?api_key=...` (it is refused: keys go in the Authorization header), and a
    log line must never hold one, so no query value is written down at all."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, str) and "?" in a for a in args):
            record.args = tuple(
                a.partition("?")[0] + REDACTED if isinstance(a, str) and "?" in a else a for a in args
            )
        return True
