"""The API reference at `/docs` (Swagger UI on /openapi.json), working offline.

FastAPI's own page fetches Swagger UI from a CDN and starts it with an inline script, so offline
it renders blank, and under a Content-Security-Policy it would not start. Here the page is a
static file in docs/ that starts Swagger UI from a script of this server's, and Swagger UI's
files come from the `fastapi-offline` package (its static files only: its app factory writes
the same inline script), all under the playground's policy.

There is no `/redoc`: ReDoc styles itself by inserting <style> elements, which that policy
(`style-src 'self'`) refuses, and ReDoc then stops with styled-components' error 17.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from server.api.errors import APIError
from server.api.playground import HEADERS

OURS = {"swagger.js": "text/javascript"}  # our start-up script
VENDORED = {  # from fastapi_offline/static: nothing else can be asked for
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
}

router = APIRouter(include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    return files("server.api").joinpath("docs", name).read_bytes()


@cache
def _vendored(name: str) -> Path:
    return Path(str(files("fastapi_offline").joinpath("static", name)))  # a wheel installs files


@router.get("/docs")
async def page() -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/docs/{name}")
async def asset(name: str) -> Response:
    if name in OURS:
        return Response(_read(name), media_type=f"{OURS[name]}; charset=utf-8", headers=HEADERS)
    if name in VENDORED:  # large: sent with an ETag, so a revisit is a 304
        return FileResponse(_vendored(name), media_type=f"{VENDORED[name]}; charset=utf-8", headers=HEADERS)
    raise APIError(404, "the API reference has no such file", code="not_found")
