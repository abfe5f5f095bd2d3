"""A server that has just become ready, at the defaults: its compile runs in the background
(`--compile auto`, the one place in the suite where a served model compiles beside its
requests). What it promises while it does: the pool's idle budget holds, the step loops' work
comes first, a drain lets the request in flight finish and the process exits 0. Real uvicorn,
the built-in model; every wait on a response, /v1/stats or the exit, with a deadline."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.live import LiveServer, free_port, live_server

BUDGET = 256 * 1024
SIZES = [(w, h) for w in range(64, 129, 8) for h in (64, 72, 80)][:24]  # 24 shapes, 2 steps each
LIMITS = {"DIFFSHARD_MAX_QUEUE": "2", "DIFFSHARD_MAX_BATCH": "1", "DIFFSHARD_MAX_STEPS": "200"}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"DIFFSHARD_COMPILE": "auto", **LIMITS}  # conftest serves eagerly; the default compiles
    cache = tmp_path_factory.mktemp("cold-cache")  # no graph another test compiled: a cold start
    args = (
        "--pool-budget",
        "256KiB",
        "--metrics-port",
        str(free_port()),
        "--drain-timeout-s",
        "30",
        "--cache-dir",
        str(cache),
    )
    with live_server(*args, env=env) as running:
        yield running


def generate(server: LiveServer, steps: int, size: str = "64x64") -> httpx.Response:
    body = {"prompt": "a red circle", "num_inference_steps": steps, "size": size, "seed": 1}
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=300)


def pool_bytes(server: LiveServer) -> tuple[float, float]:
    """The CPU pool's pooled bytes and evictions, as Prometheus scrapes them."""
    assert server.metrics_url is not None
    text = httpx.get(server.metrics_url, timeout=30).text
    found = {
        (sample.name, sample.labels.get("device")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return found["diffshard_pool_pooled_bytes", "cpu"], found["diffshard_pool_evictions_total", "cpu"]


def test_distinct_sizes_keep_pooled_bytes_within_the_budget_at_every_scrape(fresh: LiveServer) -> None:
    """The compile's own warm-up request rents nothing of the service's pool: between requests
    the pool holds idle buffers only, LRU-evicted to the budget."""
    for width, height in SIZES:
        assert generate(fresh, 2, f"{width}x{height}").status_code == 200
        pooled, evictions = pool_bytes(fresh)
        assert pooled <= BUDGET, f"{pooled:.0f} pooled bytes after {width}x{height}"
    assert evictions > 0
    assert fresh.stats()["compile"]["state"] == "compiling"  # all along beside the requests


def test_an_overload_then_a_drain_on_a_compiling_server_finish_what_they_admitted(fresh: LiveServer) -> None:
    """12 concurrent 60-step requests against a queue of 2: the admitted ones 200, the others 503
    with Retry-After; then a 150-step request in flight when SIGTERM comes answers 200 within the
    drain's 30 s, and the process exits 0 (the compile stopped, not left running into the exit)."""
    with ThreadPoolExecutor(12) as clients:
        answers = list(clients.map(lambda _: generate(fresh, 60), range(12)))
        codes = sorted(r.status_code for r in answers)
        assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
        assert all(r.headers["retry-after"] for r in answers if r.status_code == 503)
        in_flight = clients.submit(generate, fresh, 150)
        fresh.wait_for(lambda s: s["engine"]["active_jobs"] == 1)
        fresh.process.send_signal(signal.SIGTERM)
        assert in_flight.result().status_code == 200
    assert fresh.process.wait(timeout=60) == 0
    log = "".join(fresh.log)
    assert "compile stopped: the server is shutting down" in log
    assert "Traceback" not in log and "terminate called" not in log
