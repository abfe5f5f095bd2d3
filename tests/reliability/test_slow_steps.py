"""A slow step is not a dead server (issue 22), through the real server: a legal request whose
steps take many times the step timeout completes and the server keeps serving; a step past its
deadline (the `[[slow]]` fault, a fake at the device boundary) shows in readiness and metrics
until it returns, and never in liveness. `[[hang]]` still fails liveness: test_edges.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.reliability.test_edges import ANSWER_S, QUICK, assert_images, post
from tests.support.live import LiveServer, free_port, live_server
from tests.support.waiting import wait_until

# 4 images of 256² on the 64-pixel built-in model: 8 rows at 16x the native area, so each call
# gets 8x the step timeout; on 2 cores one such step takes ~2.5 s, ~10x STEP_TIMEOUT_S.
STEP_TIMEOUT_S = 0.25
BIG = {"prompt": "a red circle", "n": 4, "size": "256x256", "num_inference_steps": 3, "seed": 5}


class Probes:
    """Polls /livez and /readyz (short backoff) until stopped; keeps every status seen."""

    def __init__(self, server: LiveServer) -> None:
        self.server, self.stop = server, threading.Event()
        self.seen: dict[str, set[int]] = {"/livez": set(), "/readyz": set()}
        self.messages: list[str] = []

    def run(self) -> None:
        pause = 0.01
        with httpx.Client(base_url=self.server.url, timeout=10) as client:
            while not self.stop.wait(pause):
                for path, seen in self.seen.items():
                    answer = client.get(path)
                    seen.add(answer.status_code)
                    if answer.status_code != 200:
                        self.messages.append(answer.json()["error"]["message"])
                pause = min(2 * pause, 0.1)


def stats(server: LiveServer) -> dict:
    return httpx.get(f"{server.url}/v1/stats", timeout=10).json()["engine"]


def test_a_legal_request_with_steps_far_past_the_step_timeout_completes_and_serving_goes_on() -> None:
    with (
        live_server(
            "--step-timeout-s", str(STEP_TIMEOUT_S), "--max-pixels", str(256 * 256), "--threads", "1"
        ) as server,
        ThreadPoolExecutor(1) as pool,
    ):
        probes = Probes(server)
        watching = pool.submit(probes.run)
        try:
            big = post(server, BIG)
        finally:
            probes.stop.set()
            watching.result(timeout=ANSWER_S)
        assert_images(big, 4, 256)
        engine = stats(server)
        mean_step_s = engine["step_seconds_total"] / engine["steps"]
        assert mean_step_s >= 3 * STEP_TIMEOUT_S, f"steps of {mean_step_s:.2f} s show nothing here"
        assert probes.seen["/livez"] == {200}, probes.messages  # slow is not dead
        assert engine["stuck_calls"] == 0
        assert_images(post(server, QUICK), 1, 64)  # and the server keeps serving
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200


def test_a_step_past_its_deadline_fails_readiness_until_it_returns_and_never_liveness() -> None:
    metrics_port = free_port()
    with (
        live_server(
            "--inject-faults", "--step-timeout-s", "1", "--threads", "1", "--metrics-port", str(metrics_port)
        ) as server,
        ThreadPoolExecutor(2) as pool,
    ):
        slow = pool.submit(post, server, {**QUICK, "prompt": "a blue square [[slow]]"})
        ready = wait_until(
            lambda: (r := httpx.get(f"{server.url}/readyz", timeout=10)).status_code == 503 and r,
            ANSWER_S,
            "/readyz saying the step is slow",
        )
        assert "past its deadline" in ready.json()["error"]["message"]
        assert httpx.get(f"{server.url}/livez", timeout=10).status_code == 200
        assert_images(slow.result(timeout=ANSWER_S), 1, 64)  # it returned: the request completes
        wait_until(
            lambda: httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200, 10, "ready again"
        )
        assert stats(server)["slow_calls"] == 1
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert "diffshard_slow_steps_total 1.0" in metrics and "diffshard_stuck_steps_total 0.0" in metrics
        assert any("past its deadline" in line for line in server.log)
