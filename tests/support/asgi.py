"""A request to the app in-process, through httpx's ASGI transport (no socket)."""

from __future__ import annotations

import asyncio

import httpx


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        # 127.0.0.1: a name the Host check admits on a loopback-bound server (the default)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(call())
