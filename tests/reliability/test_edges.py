"""The service at its edges, through the real server (`python -m server serve`, the built-in
model, real HTTP): a client that reads its answer slowly, a VAE decode that raises, a batched
step that raises, text that is not valid Unicode, a step that never returns and a step loop
that dies. Faults are injected where a device fault would surface (`--inject-faults`, loopback
only, server/serving/faults.py); every wait is on an observable event with a deadline."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
from PIL import Image

from tests.support.live import LiveServer, live_server
from tests.support.waiting import wait_until

READ_TIMEOUT_S = 2.0  # the edge server's --read-timeout-s: a slow *reader* must outlast it
QUICK = {"prompt": "a blue square", "num_inference_steps": 4, "seed": 2}
LONG = {"prompt": "a red circle", "num_inference_steps": 60, "seed": 1}  # a few seconds on 2 cores
ANSWER_S = 60  # the longest any single request here may take to be answered


@pytest.fixture(scope="module")
def edges() -> Iterator[LiveServer]:
    with live_server("--inject-faults", "--read-timeout-s", str(READ_TIMEOUT_S)) as running:
        yield running


def post(server: LiveServer, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(
        f"{server.url}/v1/images/generations", content=content, headers=headers, timeout=ANSWER_S
    )


def together(server: LiveServer, bodies: list[dict | bytes]) -> list[tuple[httpx.Response, float]]:
    """Send every body at once (one thread each, released together); each response with the
    time.monotonic() it arrived at, in the order of `bodies`."""
    start = threading.Barrier(len(bodies))

    def send(body: dict | bytes) -> tuple[httpx.Response, float]:
        start.wait(timeout=ANSWER_S)
        response = post(server, body)
        return response, time.monotonic()

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(send, bodies))


def assert_envelope(response: httpx.Response, status: int, code: str | None = None) -> dict:
    """OpenAI's error envelope with this status (and code); the error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert code is None or error["code"] == code, error
    assert "Traceback" not in response.text
    return error


def assert_images(response: httpx.Response, count: int, side: int) -> None:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert len(data) == count
    for item in data:
        image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
        assert (image.format, image.size) == ("PNG", (side, side))


def status_of(server: LiveServer, path: str) -> int:
    return httpx.get(f"{server.url}{path}", timeout=10).status_code


def test_a_slow_reader_gets_its_whole_answer_and_other_clients_are_served_meanwhile(
    edges: LiveServer,
) -> None:
    """The answer (4 images of 128x128, ~90 KB) is far bigger than what the reader's small
    receive buffer lets through, so the server's writes wait on the reader; meanwhile other
    clients are answered, and the reader stalls past the read timeout, which bounds how long a
    client may take to *send* its request, never how long it may take to read the answer."""
    body = json.dumps({**QUICK, "prompt": "a white square", "size": "128x128", "n": 4}).encode()
    address = urlparse(edges.url)
    with socket.socket() as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: a small window
        reader.settimeout(ANSWER_S)
        reader.connect((address.hostname, address.port))
        reader.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = [reader.recv(64)]  # the status line: the answer has begun
        began = time.monotonic()
        assert received[0].startswith(b"HTTP/1.1 200"), received[0]

        others = together(edges, [{**QUICK, "seed": seed} for seed in range(3)])
        for response, _ in others:
            assert_images(response, 1, 64)
        assert status_of(edges, "/readyz") == 200
        # stall until past the read timeout: an answer being read slowly must not be cut off
        wait_until(lambda: time.monotonic() - began > 1.5 * READ_TIMEOUT_S, 2 * READ_TIMEOUT_S, "the stall")

        while chunk := reader.recv(512):  # then read it all, a little at a time
            received.append(chunk)
    head, _, payload = b"".join(received).partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
    assert length and int(length[1]) == len(payload) > 64 * 1024, head
    images = json.loads(payload)["data"]
    assert len(images) == 4
    for item in images:
        assert Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).size == (128, 128)


def test_a_decode_that_raises_fails_only_its_request(edges: LiveServer) -> None:
    """Both requests finish their steps together, so their images are decoded in one VAE call;
    the call raises, is retried request by request, and only the marked one fails."""
    failed = edges.stats()["engine"]["rejected"].get("failed", 0)
    (bad, _), (good, _) = together(edges, [{**QUICK, "prompt": "a red circle [[decode]]"}, QUICK])
    error = assert_envelope(bad, 500, "generation_failed")
    assert bad.headers["x-request-id"] in error["message"]  # the id the server log has the details under
    assert_images(good, 1, 64)
    assert_images(post(edges, QUICK), 1, 64)  # and the next request is served
    assert edges.stats()["engine"]["rejected"]["failed"] == failed + 1
    assert any("injected fault [[decode]]" in line for line in edges.log)


def test_a_failing_step_batched_with_three_good_requests_fails_only_itself(edges: LiveServer) -> None:
    bodies = [{**QUICK, "num_inference_steps": 8, "prompt": "a red circle [[fail]]"}]
    bodies += [{**QUICK, "num_inference_steps": 8, "seed": seed} for seed in range(3)]
    (bad, _), *good = together(edges, bodies)
    assert_envelope(bad, 500, "generation_failed")
    for response, _ in good:
        assert_images(response, 1, 64)
    assert any(re.search(r"a batch of [2-4] jobs failed", line) for line in edges.log)
    assert_images(post(edges, QUICK), 1, 64)
    assert sum(pool["bytes_in_use"] for pool in edges.stats()["pool"].values()) == 0


def test_a_lone_surrogate_is_refused_with_400_and_concurrent_requests_are_served(edges: LiveServer) -> None:
    lone_surrogate = b'{"prompt": "a red circle \\ud800", "num_inference_steps": 4}'  # JSON text, as sent
    (bad, _), *good = together(edges, [lone_surrogate, QUICK, {**QUICK, "seed": 3}, {**QUICK, "seed": 4}])
    error = assert_envelope(bad, 400)
    assert error["param"] == "prompt" and "Unicode" in error["message"], error
    for response, _ in good:
        assert_images(response, 1, 64)


def test_a_wedged_step_fails_livez_and_every_waiting_request_is_answered_503() -> None:
    """[[hang]] blocks the loop inside its 3rd step; past --step-timeout-s the watchdog answers
    every waiting request 503 and /livez fails, so Kubernetes restarts the pod."""
    step_timeout_s = 2
    with (
        live_server(  # one step loop (--threads 1: one worker): the one the hang wedges
            "--inject-faults",
            "--step-timeout-s",
            str(step_timeout_s),
            "--drain-timeout-s",
            "1",
            "--threads",
            "1",
        ) as server,
        ThreadPoolExecutor(2) as pool,
    ):
        wedged = pool.submit(post, server, {**QUICK, "prompt": "a red circle [[hang]]"})
        server.wait_for(lambda s: s["engine"]["active_jobs"] == 1)
        waiting = pool.submit(post, server, QUICK)
        server.wait_for(lambda s: s["engine"]["active_jobs"] + s["engine"]["queue_depth"] == 2)
        assert status_of(server, "/livez") == 200  # not yet past the step timeout

        wait_until(lambda: status_of(server, "/livez") == 503, 10 * step_timeout_s, "/livez answering 503")
        for response in (wedged.result(timeout=ANSWER_S), waiting.result(timeout=ANSWER_S)):
            assert_envelope(response, 503)
        livez = httpx.get(f"{server.url}/livez", timeout=10)
        assert "stuck" in assert_envelope(livez, 503, "unhealthy")["message"]
        assert status_of(server, "/readyz") == 503
        assert_envelope(post(server, QUICK), 503)  # new requests are refused at once


def test_a_killed_loop_answers_every_waiting_request_503_at_once() -> None:
    """[[kill]] kills the step-loop thread (an exception no handler catches) in its 3rd step while
    three long requests run: every one is answered 503 as it dies, and both probes fail."""
    with (
        live_server("--inject-faults", "--drain-timeout-s", "1", "--threads", "1") as server,  # one step loop
        ThreadPoolExecutor(4) as pool,
    ):
        start = threading.Barrier(3)

        def waiter(seed: int) -> tuple[httpx.Response, float]:
            start.wait(timeout=ANSWER_S)
            response = post(server, {**LONG, "seed": seed})
            return response, time.monotonic()

        waiting = [pool.submit(waiter, seed) for seed in range(3)]
        server.wait_for(lambda s: s["engine"]["active_jobs"] == 3)
        killer = post(server, {**QUICK, "prompt": "a red circle [[kill]]"})
        killed_at = time.monotonic()  # the killer is answered as the loop dies

        assert_envelope(killer, 503)
        answered = [future.result(timeout=ANSWER_S) for future in waiting]
        for response, at in answered:
            assert_envelope(response, 503)
            assert abs(at - killed_at) < 1.0, f"answered {at - killed_at:+.2f} s from the kill"
        assert any("the step loop died" in line for line in server.log)
        assert status_of(server, "/readyz") == 503
        assert status_of(server, "/livez") == 503
        assert_envelope(post(server, QUICK), 503)
