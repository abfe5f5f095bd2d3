"""One error envelope for every failure, OpenAI's: {"error": {"message", "type", "param", "code"}},
and one table from diffshard's error tree (`server/errors.py`) to HTTP.

The official SDKs turn the status into an exception class (400 BadRequestError, 401
AuthenticationError, ...) and show `message`, so every message names the field and the limit.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from server.errors import (
    Cancelled,
    DeadlineExceeded,
    DiffshardError,
    Draining,
    InvalidRequest,
    NotReady,
    OutOfMemory,
    Overloaded,
    StepFailed,
    Unavailable,
)

log = logging.getLogger("diffshard")

# The pipeline's names for request fields, as the Images API calls them.
WIRE_NAMES = {"steps": "num_inference_steps"}

# error class → (HTTP status, code); the first class in an error's MRO found here wins.
STATUS: dict[type[DiffshardError], tuple[int, str | None]] = {
    InvalidRequest: (400, "invalid_value"),
    NotReady: (503, None),  # the code is the status: loading or failed
    Overloaded: (503, "overloaded"),
    Draining: (503, "draining"),
    OutOfMemory: (503, "out_of_memory"),
    DeadlineExceeded: (504, "timeout"),
    Cancelled: (499, "cancelled"),  # nobody listens: uvicorn drops it
    StepFailed: (500, "generation_failed"),
    Unavailable: (503, "unavailable"),
}


class APIError(Exception):
    """An HTTP-only failure (auth, routing) that has no place in the domain tree."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def envelope(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def domain_response(err: DiffshardError) -> JSONResponse:
    """The envelope for an error of diffshard's tree, by the table above."""
    mapped = next((STATUS[c] for c in type(err).__mro__ if c in STATUS), None)
    if mapped is None:  # e.g. a ConfigError raised while serving: a bug, not the client's doing
        log.error("unmapped %s while serving: %s", type(err).__name__, err)
        return envelope(500, "internal server error; the server log has the details", code="internal_error")
    status, code = mapped
    message, param, headers = str(err), None, None
    if isinstance(err, InvalidRequest):
        param = WIRE_NAMES.get(err.field, err.field)
        message = f"{param}:{message.split(':', 1)[1]}" if ":" in message else message
    elif isinstance(err, NotReady):
        code = err.status
    elif isinstance(err, Overloaded):
        headers = {"retry-after": str(err.retry_after)}
    elif isinstance(err, OutOfMemory):
        headers = {"x-should-retry": "false"}  # retrying the same request would fail the same way
    elif isinstance(err, StepFailed):
        message = f"{err}; the server log has the details"
    return envelope(status, message, param, code, headers)


def _validation_message(error: dict[str, Any], content_type: str) -> tuple[str, str | None]:
    """FastAPI's first validation error as (message, param), in the API's words."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', 'parse error')}", None
    if not loc:
        if "json" not in content_type:  # FastAPI reads a body as JSON only when it says it is
            return f"send the body as JSON with Content-Type: application/json, not {content_type!r}", None
        return "the request body must be a JSON object with at least a prompt", None
    param = ".".join(loc)
    return f"{param}: {error.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(DiffshardError)
    async def domain_error(_request: Request, err: DiffshardError) -> JSONResponse:
        return domain_response(err)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, err: APIError) -> JSONResponse:
        return envelope(err.status, err.message, err.param, err.code, err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err.errors()[0], request.headers.get("content-type", ""))
        return envelope(400, message, param, "invalid_value")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 404:
            return envelope(404, f"no route {request.url.path}", code="not_found")
        if err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            return envelope(405, message, code="method_not_allowed")
        return envelope(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path, exc_info=err)
        return envelope(500, "internal server error; the server log has the details", code="internal_error")
