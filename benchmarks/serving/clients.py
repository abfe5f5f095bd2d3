"""The HTTP clients every serving benchmark runs against a real server (`tests.support.live`): a client
sending requests back to back and timing each, clients started together and the wall time until
the last is done, and the figures (images/s, latency percentiles) made from their latencies.

A request is "a red circle" at the built-in model's recommended steps (asked for explicitly, so
steps can be counted), seed `seed * 1000 + i` for a client's i-th request; `fields` adds to (or
overrides) that body, so a benchmark names only what its requests change.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import numpy as np
from PIL import Image

from tests.support.live import LiveServer

STEPS = 25  # the built-in model's recommended steps (server/demo/model/recommended.json)
STREAM = {"stream": True, "partial_images": 2, "stream_progress": True}  # as the playground asks
STRENGTH = 0.8  # an edit's strength
EDIT_STEPS = int(STEPS * STRENGTH)  # what an edit at STRENGTH runs (diffusers' get_timesteps)
T = TypeVar("T")


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def edit_files(inpaint: bool) -> dict[str, tuple[str, bytes, str]]:
    """A 64x64 red disc on a dark ground; with `inpaint`, a mask transparent on its left half."""
    yy, xx = np.mgrid[:64, :64]
    image = np.full((64, 64, 3), 14, np.uint8)
    image[(yy - 32) ** 2 + (xx - 32) ** 2 <= 18**2] = (225, 35, 35)
    files = {"image": ("image.png", _png(image), "image/png")}
    if inpaint:
        mask = np.zeros((64, 64, 4), np.uint8)
        mask[:, 32:, 3] = 255
        files["mask"] = ("mask.png", _png(mask), "image/png")
    return files


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def client_loop(
    server: LiveServer,
    requests: int,
    seed: int,
    stream: bool = False,
    edits: bool = False,
    size: int | None = None,
    *,
    fields: Mapping[str, Any] | None = None,
    timeout: float = 300,
) -> list[float]:
    """Send `requests` one after another (with `edits`, edits: img2img and inpainting in turn;
    `size`: images of that side; `fields`: over the body); the latency of each, to the answer's
    last byte (to the last event, streamed)."""
    latencies = []
    with httpx.Client(base_url=server.url, timeout=timeout) as client:
        for i in range(requests):
            body = {"prompt": "a red circle", "seed": seed * 1000 + i, "num_inference_steps": STEPS}
            body |= STREAM if stream else {}
            body |= {"size": f"{size}x{size}"} if size else {}
            body |= fields or {}
            if edits:
                form = {k: str(v) for k, v in body.items()} | {
                    "prompt": "a blue circle",
                    "strength": str(STRENGTH),
                }
                post = {"url": "/v1/images/edits", "data": form, "files": edit_files(inpaint=i % 2 == 1)}
            else:
                post = {"url": "/v1/images/generations", "json": body}
            started = time.perf_counter()
            with client.stream("POST", **post) as response:
                response.raise_for_status()
                events = sum(line.startswith("event: image_") for line in response.iter_lines())
            latencies.append(time.perf_counter() - started)
            if stream and events != 3:  # two partial images and the completed one (and progress)
                raise RuntimeError(f"{events} image events, not 3")
    return latencies


def lone(server: LiveServer, body: Mapping[str, Any], timeout: float = 300) -> float:
    """Seconds for one request of `body` (over the default body: see the module's doc)."""
    return client_loop(server, 1, 0, fields=body, timeout=timeout)[0]


def at_once(clients: int, client: Callable[[int], T]) -> tuple[list[T], float]:
    """`client(0)` … `client(clients - 1)`, a thread each, started together: their results, and
    the wall seconds until the last one returned (what images/s is computed over)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    return results, time.perf_counter() - started


def rate(runs: list[list[float]], wall: float) -> dict[str, float]:
    """Images/s over `wall` and the p50 latency of the clients' `runs`, unrounded: medians over
    rounds are taken of these, and rounded once."""
    latencies = [seconds for run in runs for seconds in run]
    return {"images_per_s": len(latencies) / wall, "p50_s": percentile(latencies, 0.5)}


def medians(table: Mapping[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per way, the median over rounds of each `rate` figure, to 3 decimals."""
    return {
        way: {k: round(statistics.median(r[k] for r in rows), 3) for k in ("images_per_s", "p50_s")}
        for way, rows in table.items()
    }


def summary(runs: list[list[float]], wall: float, steps: int | None = None) -> dict[str, Any]:
    """Images, wall time, images/s (and denoising steps/s, given `steps`) and latency percentiles
    of the clients' `runs` (latencies)."""
    latencies = [seconds for run in runs for seconds in run]
    figures = {
        "images": len(latencies),
        "wall_s": round(wall, 3),
        "images_per_s": round(len(latencies) / wall, 3),
        "p50_s": round(percentile(latencies, 0.5), 3),
        "p95_s": round(percentile(latencies, 0.95), 3),
    }
    if steps is not None:
        figures["steps_per_s"] = round(steps / wall, 3)
    return figures


def compiled_after(server: Any, started: float, deadline_s: float = 1800) -> dict[str, Any]:
    """Wait for `server`'s background compile to end (polling /v1/stats with a short backoff):
    seconds from `started`, and its `compile` view (the buckets kept and their timings)."""
    wait, ends = 0.05, time.monotonic() + deadline_s
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while True:
            try:
                view = client.get("/v1/stats").json()["compile"]
            except httpx.TransportError:  # a kept-alive connection closed as this poll went out
                if server.process.poll() is not None:
                    raise
                view = {"state": "compiling"}  # polled again, on a new connection
            if view["state"] in ("ready", "stopped", "failed", "off") or time.monotonic() > ends:
                return {**view, "ready_after_s": round(time.perf_counter() - started, 2)}
            time.sleep(wait)  # polling a server's progress: no event to wait on across processes
            wait = min(1.0, wait * 2)
