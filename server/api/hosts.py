"""The Host check: a request naming a host the server does not answer to is refused before
anything else reads it. A server on loopback answers only loopback names by default, so a web
page that points its own domain at 127.0.0.1 (DNS rebinding) cannot reach it; a public one
names its hosts with `--allowed-hosts` (default `*`: pod IPs and Service names vary).

The matching is Starlette's `TrustedHostMiddleware` (never redirecting: `www_redirect` off, so
no `Location` is built from a client's Host); the refusal is our envelope.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import envelope

PASSED = "diffshard.host_allowed"  # set in the scope by the check's inner app


async def _passed(scope: Scope, _receive: Receive, _send: Send) -> None:
    scope[PASSED] = True


async def _discard(_message: Message) -> None:  # Starlette's own plain-text refusal: ours is sent instead
    pass


class TrustedHosts:
    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str]) -> None:
        self.app = app
        self.allowed = tuple(allowed_hosts)
        self.check = TrustedHostMiddleware(_passed, allowed_hosts=list(allowed_hosts), www_redirect=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.check.allow_any:
            await self.app(scope, receive, send)
            return
        await self.check(scope, receive, _discard)
        if scope.pop(PASSED, False):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
        shown = given if len(given) <= 80 else given[:77] + "..."
        message = (
            f"host: {shown!r} is not a host this server answers to; it answers "
            f"{', '.join(self.allowed)} (DIFFSHARD_ALLOWED_HOSTS)"
        )
        await envelope(400, message, "host", code="invalid_host")(scope, receive, send)
