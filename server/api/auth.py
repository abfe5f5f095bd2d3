"""Bearer keys on /v1/*: `Authorization: Bearer <key>`, compared in constant time. A 401 says
`WWW-Authenticate: Bearer` (RFC 6750), so clients and proxies know which scheme to offer."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.api.errors import APIError

CHALLENGE = {"www-authenticate": 'Bearer realm="diffshard"'}
WRONG_KEY = {"www-authenticate": 'Bearer realm="diffshard", error="invalid_token"'}


def require_key(request: Request) -> None:
    keys: frozenset[str] | None = request.app.state.api_keys
    if keys is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        message = "missing API key: send the header Authorization: Bearer <key>"
        raise APIError(401, message, code="invalid_api_key", headers=CHALLENGE)
    given = token.strip().encode()
    # every key is compared, so the time taken does not tell which key came close
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    if not matched:
        raise APIError(401, "incorrect API key", code="invalid_api_key", headers=WRONG_KEY)
