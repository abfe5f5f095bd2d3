"""Serving throughput and latency over real HTTP: step-level batching vs one request at a time,
and streaming partial images vs plain requests.

Two real servers (`python -m server serve`, the built-in model, its recommended 25 steps and
guidance) run side by side: `batched` with the default settings, and `one_at_a_time` with
`--max-batch 2`, so a single guided request (2 UNet rows) fills every step, as a server that
runs requests one after another does. A third column, `streaming`, is the batched server with
every request as the playground sends it, `stream: true, partial_images: 2, stream_progress:
true` (each event read as it comes). A fourth, `mixed`, is the batched server with half the
clients (the odd ones: with 1 client, none) sending edits (`/v1/images/edits` of a 64x64 image
at strength 0.8, img2img and inpainting in turn) and half generations. For 1, 4, 8 and 16
concurrent clients, each sending requests back to back, all four are measured in the same round
(in alternating order): images/s and denoising steps/s over the round's wall time, and per-
request latency percentiles. Every request asks for 25 steps; an edit at strength s runs int(25
s) of them, so the mixed column is compared by steps/s, not images/s.

One JSON object per (clients, server, round), then a summary: medians over rounds, the
throughput ratio batched / one_at_a_time, streaming / batched, mixed / batched (steps/s), and
p95 latency at 8 clients over a lone request. Targets: batching 3x at 8 clients with p95 at
most 4x a lone request; streaming and mixed at least 0.9x plain throughput at 8 clients.

    python -m benchmarks.serving [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import numpy as np
from PIL import Image

from tests.live import LiveServer, live_server

CLIENTS = (1, 4, 8, 16)
SERVERS = {"batched": (), "one_at_a_time": ("--max-batch", "2")}
COLUMNS = {  # → server
    "batched": "batched",
    "one_at_a_time": "one_at_a_time",
    "streaming": "batched",
    "mixed": "batched",
}
STEPS = 25  # the built-in model's recommended steps, asked for explicitly so steps can be counted
STREAM = {"stream": True, "partial_images": 2, "stream_progress": True}
STRENGTH = 0.8
EDIT_STEPS = int(STEPS * STRENGTH)  # what an edit at STRENGTH runs (diffusers' get_timesteps)
TARGET_SPEEDUP_AT_8 = 3.0
TARGET_STREAMING_AT_8 = 0.9
TARGET_MIXED_AT_8 = 0.9
TARGET_P95_OVER_LONE_AT_8 = 4.0


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
) -> list[float]:
    """Send `requests` one after another (with `edits`, edits: img2img and inpainting in turn;
    `size`: images of that side); the latency of each (to the last event, streamed)."""
    latencies = []
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for i in range(requests):
            body = {"prompt": "a red circle", "seed": seed * 1000 + i, "num_inference_steps": STEPS}
            body |= STREAM if stream else {}
            body |= {"size": f"{size}x{size}"} if size else {}
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


def measure(server: LiveServer, clients: int, per_client: int, column: str = "batched") -> dict[str, Any]:
    """`clients` clients' requests on `server` as `column` sends them (mixed: odd clients edit)."""
    started = time.perf_counter()
    editing = [column == "mixed" and c % 2 == 1 for c in range(clients)]
    with ThreadPoolExecutor(clients) as pool:
        runs = list(
            pool.map(
                lambda c: client_loop(server, per_client, c, column == "streaming", editing[c]),
                range(clients),
            )
        )
    steps = sum(len(run) * (EDIT_STEPS if edit else STEPS) for run, edit in zip(runs, editing, strict=True))
    return summary(runs, time.perf_counter() - started, steps)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round of 1 request per client, not 3 of 3")
    parser.add_argument(
        "--clients", type=lambda v: [int(c) for c in v.split(",")], default=list(CLIENTS), help="e.g. 1,8"
    )
    args = parser.parse_args(argv)
    rounds, per_client = (1, 1) if args.quick else (3, 3)
    counts = tuple(sorted({*args.clients, 1, 8}))  # the targets read 1 and 8 clients

    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        servers = {name: stack.enter_context(live_server(*flags)) for name, flags in SERVERS.items()}
        for server in servers.values():
            measure(server, 2, 1)  # warm-up
        for clients in counts:
            for round_ in range(rounds):
                order = list(COLUMNS) if round_ % 2 == 0 else list(reversed(COLUMNS))
                for name in order:
                    server = servers[COLUMNS[name]]
                    row = {"clients": clients, "server": name, "round": round_}
                    before = server.stats()["engine"]["batch_rows"]
                    row |= measure(server, clients, per_client, name)
                    after = server.stats()["engine"]["batch_rows"]
                    row["largest_batch_rows"] = max(
                        int(n) for n, calls in after.items() if calls > before.get(n, 0)
                    )
                    rows.append(row)
                    print(json.dumps(row), flush=True)

    def median(clients: int, server: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["clients"] == clients and r["server"] == server)

    table = {
        f"{server}_{clients}": {
            key: median(clients, server, key) for key in ("images_per_s", "steps_per_s", "p50_s", "p95_s")
        }
        for clients in counts
        for server in COLUMNS
    }
    speedups = {
        clients: round(
            median(clients, "batched", "images_per_s") / median(clients, "one_at_a_time", "images_per_s"), 3
        )
        for clients in counts
    }
    streaming = {
        clients: round(
            median(clients, "streaming", "images_per_s") / median(clients, "batched", "images_per_s"), 3
        )
        for clients in counts
    }
    mixed = {
        clients: round(median(clients, "mixed", "steps_per_s") / median(clients, "batched", "steps_per_s"), 3)
        for clients in counts
    }
    lone = median(1, "batched", "p50_s")
    p95_ratio = round(median(8, "batched", "p95_s") / lone, 3)
    summary = {
        "summary": True,
        "rounds": rounds,
        "requests_per_client": per_client,
        "table": table,
        "throughput_speedup": {str(c): s for c, s in speedups.items()},
        "streaming_over_plain": {str(c): s for c, s in streaming.items()},
        "mixed_over_plain_steps_per_s": {str(c): s for c, s in mixed.items()},
        "lone_request_p50_s": lone,
        "p95_at_8_over_lone": p95_ratio,
        "targets": {
            "speedup_at_8": TARGET_SPEEDUP_AT_8,
            "p95_at_8_over_lone": TARGET_P95_OVER_LONE_AT_8,
            "streaming_over_plain_at_8": TARGET_STREAMING_AT_8,
            "mixed_over_plain_at_8": TARGET_MIXED_AT_8,
        },
        "targets_met": {
            "speedup_at_8": speedups[8] >= TARGET_SPEEDUP_AT_8,
            "p95_at_8_over_lone": p95_ratio <= TARGET_P95_OVER_LONE_AT_8,
            "streaming_over_plain_at_8": streaming[8] >= TARGET_STREAMING_AT_8,
            "mixed_over_plain_at_8": mixed[8] >= TARGET_MIXED_AT_8,
        },
    }
    summary["meets_target"] = all(summary["targets_met"].values())
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
