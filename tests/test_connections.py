"""The private uvicorn API `server/api/connections.py` builds on, checked by name.

`_Bounded` subclasses uvicorn's `H11Protocol` (no public setting bounds the time to a request's
headers) and reads its attributes, so pyproject.toml pins uvicorn to the minor version it was
tested with. These tests fail first, and say what changed, when that pin is moved or bypassed;
what the bounds do on the wire is tests/test_http.py's.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import tomllib
from pathlib import Path

import h11
import uvicorn
from packaging.requirements import Requirement
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from server.api.connections import bounded_protocol

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
RECHECK = (
    "server/api/connections.py relies on it: re-read uvicorn's protocols/http/h11_impl.py, "
    "adapt connections.py, then move the uvicorn pin in pyproject.toml"
)


def uvicorn_requirement() -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return next(Requirement(d) for d in dependencies if Requirement(d).name == "uvicorn")


def test_uvicorn_pin_is_an_upper_bounded_range_and_the_installed_one_is_in_it() -> None:
    requirement = uvicorn_requirement()
    assert any(spec.operator == "<" for spec in requirement.specifier), (
        f"pyproject.toml's {requirement} has no upper bound; {RECHECK}"
    )
    assert requirement.specifier.contains(uvicorn.__version__), (
        f"uvicorn {uvicorn.__version__} is installed, outside pyproject.toml's {requirement}; {RECHECK}"
    )


def test_h11_protocol_takes_the_arguments_uvicorn_server_passes() -> None:
    parameters = list(inspect.signature(H11Protocol.__init__).parameters)
    assert parameters == ["self", "config", "server_state", "app_state", "_loop"], (
        f"uvicorn {uvicorn.__version__}'s H11Protocol.__init__ takes {parameters}; {RECHECK}"
    )


async def _asgi_app(scope, receive, send) -> None:  # never called: no request is sent
    raise AssertionError("no request was expected")


def test_h11_protocol_has_the_attributes_bounded_connections_read() -> None:
    async def connect() -> None:
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(_asgi_app, http=bounded_protocol(read_timeout_s=60, max_connections=4))
        config.load()
        state = ServerState()
        server_end, client_end = socket.socketpair()
        with client_end:
            transport, protocol = await loop.connect_accepted_socket(
                lambda: config.http_protocol_class(config=config, server_state=state, app_state={}),
                server_end,
            )
            try:
                found = {
                    "conn (an h11.Connection)": isinstance(getattr(protocol, "conn", None), h11.Connection),
                    "connections (server_state.connections)": getattr(protocol, "connections", None)
                    is state.connections,
                    "loop (the running loop)": getattr(protocol, "loop", None) is loop,
                    "transport (set by connection_made)": getattr(protocol, "transport", None) is transport,
                    "the connection counted in connections": protocol in state.connections,
                    "conn.their_state (IDLE before any byte)": getattr(
                        getattr(protocol, "conn", None), "their_state", None
                    )
                    is h11.IDLE,
                }
                missing = [name for name, ok in found.items() if not ok]
                assert not missing, f"uvicorn {uvicorn.__version__}'s H11Protocol lacks {missing}; {RECHECK}"
            finally:
                transport.close()
                await asyncio.sleep(0)  # let connection_lost run: the header timer is cancelled

    asyncio.run(connect())
