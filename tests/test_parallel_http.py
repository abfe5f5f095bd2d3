"""Replicas and pipelined stages over HTTP: the built-in model served with `--devices cpu,cpu`
(two CPU workers, one thread each) and `--parallel pipeline` or `replicas` returns the images
the default server returns for the same seeds, under concurrent load, with both workers busy."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from server.metrics import PREFIX
from tests.support.live import LiveServer, free_port, live_server

REQUESTS = [
    {"prompt": p, "seed": s, "num_inference_steps": 8}
    for p in ("a red circle", "a blue square")
    for s in range(3)
]


def generate_all(server: LiveServer) -> list[np.ndarray]:
    """Every request of REQUESTS at once (6 clients), each image as a uint8 array."""
    with httpx.Client(base_url=server.url, timeout=120) as client, ThreadPoolExecutor(len(REQUESTS)) as pool:
        answers = list(pool.map(lambda body: client.post("/v1/images/generations", json=body), REQUESTS))
    assert [a.status_code for a in answers] == [200] * len(REQUESTS), [a.text for a in answers]
    return [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(a.json()["data"][0]["b64_json"])))).astype(int)
        for a in answers
    ]


@pytest.fixture(scope="module")
def reference() -> list[np.ndarray]:
    with live_server() as server:
        return generate_all(server)


@pytest.fixture(scope="module", params=["pipeline", "replicas"])
def parallel(request) -> Iterator[tuple[str, LiveServer]]:
    metrics = free_port()
    with live_server(
        "--devices", "cpu,cpu", "--parallel", request.param, "--metrics-port", str(metrics)
    ) as server:
        yield request.param, server, f"http://127.0.0.1:{metrics}/metrics"


def test_same_images_as_the_default_server_under_concurrent_load(parallel, reference) -> None:
    mode, server, _ = parallel
    images = generate_all(server)
    # rows batched differently may differ in the last bits of a GEMM: one 8-bit level at most
    worst = max(int(np.abs(a - b).max()) for a, b in zip(images, reference, strict=True))
    assert worst <= 1, f"{mode}: a pixel differs by {worst} levels"


def test_both_workers_were_busy_and_the_plan_says_how(parallel) -> None:
    mode, server, metrics = parallel
    shards = httpx.get(f"{server.url}/v1/shards").json()
    assert shards["parallel"]["lanes"] == 2 and shards["parallel"]["threads_per_lane"] == 1
    assert (shards["parallel"]["replicas"], shards["parallel"]["stages"]) == {
        "pipeline": (1, 2),
        "replicas": (2, 1),
    }[mode]
    busy = shards["parallel"]["busy_seconds"]
    assert set(busy) == {"cpu:0", "cpu:1"} and min(busy.values()) > 0, busy
    text = httpx.get(metrics).text
    for worker in ("cpu:0", "cpu:1"):
        assert f'{PREFIX}_device_busy_seconds_total{{device="{worker}"}}' in text
    assert f"{PREFIX}_micro_batches_in_flight" in text


def test_a_lone_request_on_replicas_gives_the_same_image_and_the_plan_says_if_it_splits(reference) -> None:
    """One client, two replicas: the image is the single worker's; the second worker works on it
    exactly when the plan predicts that splitting a lone request's rows pays."""
    with (
        live_server("--devices", "cpu,cpu", "--parallel", "replicas") as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        answer = client.post("/v1/images/generations", json=REQUESTS[0])
        assert answer.status_code == 200, answer.text
        shards = client.get("/v1/shards").json()
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))).astype(
        int
    )
    assert int(np.abs(image - reference[0]).max()) <= 2  # within 2/255 of the unsplit rows
    busy = shards["parallel"]["busy_seconds"]
    splits = shards["parallel"]["splits_lone_requests"]
    assert (busy["cpu:1"] > 0) == splits, (splits, busy)
