"""Start `python -m server serve` as a process of its own on a free loopback port and wait until
it is ready: for the tests and benchmarks that need the real thing (uvicorn, its lifespan, the
body limit, signals); in the test session forked from its fork server (`tests/support/forking.py`).
Readiness is the "ready:" line the service logs once the model is loaded, an event awaited with
a deadline, not a sleep."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from tests.support.forking import Forked

STARTUP_DEADLINE_S = 120
# the test session's fork server, started on first use (conftest's `fork_server`); None elsewhere
forking: Callable[[], Forked] | None = None
ROOT = Path(__file__).resolve().parents[2]
# `make run`'s arguments (the Makefile's): the built-in model with the diamond adapter and the
# silhouette ControlNet
MAKE_RUN = (
    "--lora",
    f"diamond={ROOT / 'server/demo/adapters/diamond.safetensors'}",
    "--controlnet",
    f"silhouette={ROOT / 'server/demo/controlnets/silhouette'}",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    process: Any  # a subprocess.Popen, or a tests.forking.ForkedProcess: the same calls
    log: list[str] = field(default_factory=list)
    metrics_url: str | None = None  # with --metrics-port

    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/v1/stats", timeout=30) as response:
            return json.load(response)

    def wait_for(self, condition: Callable[[dict], bool], timeout_s: float = 60) -> dict:
        """Poll /v1/stats, with a short backoff, until `condition` holds; AssertionError with the
        last reading at the deadline."""
        last: dict = {}

        def reading() -> dict | None:
            nonlocal last
            last = self.stats()
            return last if condition(last) else None

        try:
            return wait_until(reading, timeout_s, "/v1/stats meeting the condition")
        except AssertionError as missed:
            raise AssertionError(f"{missed}; last stats: {last}") from None


def _pump(stream, lines: queue.Queue, log: list[str]) -> None:
    for line in stream:
        log.append(line)
        lines.put(line)
    lines.put(None)  # end of output: the process exited


@contextmanager
def live_server(
    *args: str,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
    startup_deadline_s: float = STARTUP_DEADLINE_S,
    fresh: bool = False,
) -> Iterator[LiveServer]:
    """`python -m server serve *args` on a free loopback port; `prefix` runs it under another
    command (e.g. `taskset -c 0`). In the test session it is forked from the session's fork
    server (`forking`: torch and the app imported once), unless under a prefix or `fresh`: an
    interpreter started from nothing, as a restart is (a forked server's inductor cache keys
    differ from a fresh one's: a restart's cache hits are measured fresh)."""
    port = free_port()
    metrics = [] if "--metrics-port" in args else ["--metrics-port", "0"]  # off unless asked for
    argv = ["server", "serve", "--host", "127.0.0.1", "--port", str(port), *metrics, *args]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    forks = forking() if forking is not None and not prefix and not fresh else None
    if forks is not None and forks.forkable:
        read, write = os.pipe()
        try:
            with open(os.devnull, "wb") as devnull:
                process: Any = forks.spawn(*argv, env=environment, stdout=devnull.fileno(), stderr=write)
        finally:
            os.close(write)  # the server's alone now: its exit ends the stream
        stderr = os.fdopen(read, encoding="utf-8", errors="replace")
    else:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        )
        stderr = process.stderr
    server = LiveServer(f"http://127.0.0.1:{port}", process)
    if "--metrics-port" in args:
        server.metrics_url = f"http://127.0.0.1:{args[args.index('--metrics-port') + 1]}/metrics"
    lines: queue.Queue = queue.Queue()
    pump = threading.Thread(target=_pump, args=(stderr, lines, server.log), daemon=True)
    pump.start()
    try:
        deadline = time.monotonic() + startup_deadline_s
        while True:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError("the server exited during startup:\n" + "".join(server.log))
            if "diffshard: ready:" in line:
                break
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)
        pump.join(timeout=30)  # reads to the end of the closed pipe
        stderr.close()


def sse(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """(event, data) of a server-sent event stream, as they arrive."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield event, json.loads(line.removeprefix("data: "))
