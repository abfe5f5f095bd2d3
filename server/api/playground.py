"""The playground at `/`: one static page (HTML, CSS and plain JavaScript in playground/, no
build step, nothing from a CDN) that streams generations from this server's own API.

The page itself is public: it holds no data, and asks for an API key (kept in the tab's session
storage) only when /v1 answers 401. A strict Content-Security-Policy lets it load its own files
and talk to this origin only; images arrive as data the page turns into blob URLs, and so do
videos (fetched with the page's key, which a <video src> could not send: hence `media-src blob:`).
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

from server.api.errors import APIError

FILES = {  # what /playground/{name} serves: nothing else can be asked for
    "playground.js": "text/javascript",
    "lora.js": "text/javascript",
    "control.js": "text/javascript",
    "edit.js": "text/javascript",
    "mode.js": "text/javascript",
    "video.js": "text/javascript",
    "batches.js": "text/javascript",
    "playground.css": "text/css",
}
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data: blob:; media-src blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",  # revalidate: a new version of the server brings a new page
}

router = APIRouter(include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    return files("server.api").joinpath("playground", name).read_bytes()


@router.get("/")
async def page() -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/playground/{name}")
async def asset(name: str) -> Response:
    if name not in FILES:
        raise APIError(404, "the playground has no such file", code="not_found")
    return Response(_read(name), media_type=f"{FILES[name]}; charset=utf-8", headers=HEADERS)
