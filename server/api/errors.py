"""One error envelope for every failure, OpenAI's: {"error": {"message", "type", "param", "code"}}.

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

log = logging.getLogger("diffshard")

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}


class APIError(Exception):
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
    kind = "server_error" if status >= 500 else TYPES.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


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
