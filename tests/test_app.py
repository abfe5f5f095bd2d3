"""The app in process, before its lifespan has loaded anything (httpx's ASGI transport runs no
lifespan): what a client sees while the model loads, and how an internal error looks."""

from __future__ import annotations

import asyncio

import httpx

from server.app import create_app
from server.config import Settings


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(call())


def test_while_loading_livez_answers_and_readyz_and_generation_say_503() -> None:
    app = create_app(Settings())
    assert request(app, "GET", "/livez").status_code == 200
    ready = request(app, "GET", "/readyz")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "loading"
    generation = request(app, "POST", "/v1/images/generations", json={"prompt": "a red circle"})
    assert generation.status_code == 503 and "loading" in generation.json()["error"]["message"]


def test_an_internal_error_is_a_500_envelope_without_the_traceback() -> None:
    app = create_app(Settings())

    @app.get("/v1/boom")
    async def boom() -> None:  # a route that fails as a bug would
        raise RuntimeError("secret internals")

    response = request(app, "GET", "/v1/boom")
    assert response.status_code == 500
    error = response.json()["error"]
    assert (
        error["type"] == "server_error" and "secret" not in response.text and "Traceback" not in response.text
    )
