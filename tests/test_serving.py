"""The engine loop behind the real server (`python -m server serve`, the built-in model, real
HTTP): overload, deadlines, disconnects, step failures and the graceful drain. Every wait is
on an observable event (the engine's stats, a response, the process exit) with a deadline."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest

from tests.support.live import LiveServer, live_server
from tests.support.waiting import wait_until

LONG = {"prompt": "a red circle", "num_inference_steps": 100, "seed": 1}  # ~2 s on 2 cores
QUICK = {"prompt": "a blue square", "num_inference_steps": 2, "seed": 2}


@pytest.fixture(scope="module")
def busy() -> Iterator[LiveServer]:
    """One guided image fills a step (2 rows), one more may wait; faults can be injected."""
    with live_server(
        "--max-batch", "2", "--max-queue", "1", "--parallel", "off", "--inject-faults"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


def bytes_in_use(stats: dict) -> int:
    """Pooled bytes requests still hold, over every device the server rents on (cpu, or cuda:N
    with `serve`'s default `--devices auto` on a GPU host)."""
    assert stats["pool"], "the pool has rented on no device"
    return sum(device["bytes_in_use"] for device in stats["pool"].values())


def post(server: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)


def post_later(pool: ThreadPoolExecutor, server: LiveServer, body: dict) -> Future:
    return pool.submit(post, server, body)


def test_a_full_queue_answers_503_with_retry_after(busy: LiveServer, background) -> None:
    running = post_later(background, busy, LONG)
    busy.wait_for(lambda s: s["engine"]["active_jobs"] == 1)
    waiting = post_later(background, busy, QUICK)
    busy.wait_for(lambda s: s["engine"]["queue_depth"] == 1)

    refused = post(busy, QUICK)
    assert refused.status_code == 503
    assert 1 <= int(refused.headers["retry-after"]) <= 120
    assert (
        refused.json()["error"]["code"] == "overloaded"
        and "queue is full" in refused.json()["error"]["message"]
    )
    assert running.result().status_code == 200 and waiting.result().status_code == 200
    assert busy.stats()["engine"]["rejected"]["queue_full"] >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnected_client_is_cancelled_and_its_buffers_returned(busy: LiveServer, stream: bool) -> None:
    """A plain request's client, or a stream's (`stream: true`: the event stream's end cancels it)."""
    before = busy.stats()["engine"]["rejected"].get("cancelled", 0)
    address = urlparse(busy.url)
    body = json.dumps({**LONG, "stream": stream}).encode()
    with socket.create_connection((address.hostname, address.port)) as client:
        client.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        busy.wait_for(lambda s: s["engine"]["active_jobs"] == 1)
    # the socket is closed: the job goes at the next step boundary, long before its 100 steps
    stats = busy.wait_for(
        lambda s: (
            s["engine"]["rejected"].get("cancelled", 0) == before + 1 and s["engine"]["active_jobs"] == 0
        )
    )
    assert bytes_in_use(stats) == 0
    assert post(busy, QUICK).status_code == 200


@pytest.mark.parametrize(
    ("marker", "status", "code"), [("[[fail]]", 500, "generation_failed"), ("[[oom]]", 503, "out_of_memory")]
)
def test_a_failing_step_fails_only_its_requests(busy: LiveServer, background, marker, status, code) -> None:
    reason = {"[[fail]]": "failed", "[[oom]]": "oom"}[marker]  # as /metrics names it
    before = busy.stats()["engine"]["rejected"].get(reason, 0)
    failing = post_later(
        background, busy, {**LONG, "prompt": f"a red circle {marker}", "num_inference_steps": 5}
    )
    # admitted (or already failed), so the one-place queue has room again
    busy.wait_for(
        lambda s: s["engine"]["active_jobs"] == 1 or s["engine"]["rejected"].get(reason, 0) > before
    )
    other_size = post_later(background, busy, {**QUICK, "size": "32x32"})  # another group, another call
    response = failing.result()
    assert response.status_code == status and response.json()["error"]["code"] == code
    assert "Traceback" not in response.text
    if marker == "[[oom]]":
        assert response.headers["x-should-retry"] == "false"  # the SDK must not retry it as-is
    assert other_size.result().status_code == 200
    assert post(busy, QUICK).status_code == 200
    assert bytes_in_use(busy.stats()) == 0


def test_a_request_past_its_deadline_gets_504() -> None:
    with live_server("--request-timeout-s", "0.5") as server:
        response = post(server, LONG)
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["code"] == "timeout" and "DIFFSHARD_REQUEST_TIMEOUT_S" in error["message"]
        stats = server.stats()
        assert stats["engine"]["rejected"]["timeout"] == 1 and bytes_in_use(stats) == 0
        assert post(server, QUICK).status_code == 200


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(background) -> None:
    with live_server("--drain-timeout-s", "60") as server:
        in_flight = post_later(background, server, LONG)
        server.wait_for(lambda s: s["engine"]["active_jobs"] == 1)
        server.process.send_signal(signal.SIGTERM)

        refused = post(server, QUICK)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert httpx.get(f"{server.url}/readyz").status_code == 503
        assert in_flight.result().status_code == 200
        assert server.process.wait(timeout=60) == 0


def test_a_drain_that_times_out_answers_the_requests_left_503(background) -> None:
    with live_server("--drain-timeout-s", "0.2") as server:
        in_flight = post_later(background, server, LONG)
        server.wait_for(lambda s: s["engine"]["active_jobs"] == 1)
        server.process.send_signal(signal.SIGTERM)
        response = in_flight.result()
        assert response.status_code == 503 and response.json()["error"]["code"] == "draining"
        assert server.process.wait(timeout=60) == 0


def test_a_second_signal_answers_what_is_in_flight_503_and_exits_without_tracebacks(background) -> None:
    with live_server("--drain-timeout-s", "60") as server:
        in_flight = post_later(background, server, LONG)
        server.wait_for(lambda s: s["engine"]["active_jobs"] == 1)
        server.process.send_signal(signal.SIGINT)
        wait_until(lambda: any("draining" in line for line in server.log), 30, "the drain to begin")
        server.process.send_signal(signal.SIGINT)
        response = in_flight.result()
        assert response.status_code == 503 and response.json()["error"]["code"] == "draining"
        assert server.process.wait(timeout=60) == 0
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in server.log)
