"""Bearer keys on /v1/*: `Authorization: Bearer <key>`, compared in constant time. A 401 says
`WWW-Authenticate: Bearer` (RFC 6750), so clients and proxies know which scheme to offer.

The key a request came with names its owner (`request.state.owner`, a digest, never the key):
the step loop's line is fair between owners, and /v1/stats shows each only its own jobs. Admin
keys (`--admin-key-file`) are operators: they see every job. Without keys everyone is."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from server.api.errors import APIError

CHALLENGE = {"www-authenticate": 'Bearer realm="diffshard"'}
WRONG_KEY = {"www-authenticate": 'Bearer realm="diffshard", error="invalid_token"'}


def owner_of(key: str) -> str:
    """A key's name in the line and the stats: its digest's head, which does not reveal it."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def require_key(request: Request) -> None:
    keys: frozenset[str] | None = request.app.state.api_keys
    admins: frozenset[str] = request.app.state.admin_keys or frozenset()
    request.state.owner, request.state.admin = None, True
    if keys is None and not admins:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        message = "missing API key: send the header Authorization: Bearer <key>"
        raise APIError(401, message, code="invalid_api_key", headers=CHALLENGE)
    given = token.strip().encode()
    # every key is compared, so the time taken does not tell which key came close
    matched = admin = False
    for key in keys or ():
        matched |= hmac.compare_digest(given, key.encode())
    for key in admins:
        admin |= hmac.compare_digest(given, key.encode())
    if not (matched or admin):
        raise APIError(401, "incorrect API key", code="invalid_api_key", headers=WRONG_KEY)
    request.state.owner, request.state.admin = owner_of(token.strip()), admin
