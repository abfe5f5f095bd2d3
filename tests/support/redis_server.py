"""A real `redis-server` for the tests of the Redis job store (Debian's, installed by
`make test-tools`): on a free loopback port, in memory only, stopped when the test ends."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.support.live import free_port
from tests.support.waiting import wait_until


@dataclass
class RedisServer:
    url: str  # database 0
    process: subprocess.Popen

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@contextmanager
def redis_server(folder: Path) -> Iterator[RedisServer]:
    program = shutil.which("redis-server")
    if program is None:
        pytest.fail("redis-server is not on PATH: `make test-tools` installs Debian's redis-server")
    port = free_port()
    process = subprocess.Popen(
        [
            program,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=1)

    def answering() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            assert process.poll() is None, "redis-server exited at startup"
            return False

    try:
        wait_until(answering, 30, "redis-server answering")
        yield RedisServer(url, process)
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)
