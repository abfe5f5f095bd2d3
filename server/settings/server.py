"""Where the service listens, who may call it, and its connections: what `__main__` binds and
the HTTP layer's middleware reads."""

from __future__ import annotations

from pydantic import Field

from server.settings.values import AllowedHosts, Concern, KeyFile, trusted_hosts


class ServerSettings(Concern):
    title = "where to listen, who may call, connections, the drain on SIGTERM"

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(8000, ge=1, le=65535, description="HTTP API port")
    metrics_port: int = Field(8001, ge=0, le=65535, description="/metrics and the probes; no auth (0: off)")
    allowed_hosts: AllowedHosts = Field(
        None,
        description="Host headers the API answers, e.g. api.example.com,*.example.com or * (default: "
        "localhost, 127.0.0.1 and [::1] when host is a loopback address, else *)",
    )
    api_key_file: KeyFile | None = Field(None, description="bearer keys, one a line; unset: no auth")
    admin_key_file: KeyFile | None = Field(
        None, description="operators' bearer keys, one a line: they also see every key's jobs in /v1/stats"
    )
    read_timeout_s: float = Field(30, gt=0, description="time a client may take to send headers and body")
    sse_keepalive_s: float = Field(
        15, gt=0, le=300, description="a stream quiet this long sends an SSE comment, so proxies keep it open"
    )
    max_connections: int = Field(512, ge=1, description="concurrent connections; beyond it: 503")
    drain_timeout_s: float = Field(30, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    debug: bool = Field(False, description="print tracebacks of startup failures")

    @property
    def trusted_hosts(self) -> tuple[str, ...]:
        return trusted_hosts(self.allowed_hosts, self.host)
