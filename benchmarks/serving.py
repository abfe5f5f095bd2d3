"""Serving throughput and latency over real HTTP: step-level batching vs one request at a time,
and streaming partial images vs plain requests.

Two real servers (`python -m server serve`, the built-in model, its recommended 25 steps and
guidance) run side by side: `batched` with the default settings, and `one_at_a_time` with
`--max-batch 2`, so a single guided request (2 UNet rows) fills every step, as a server
that runs requests one after another does. A third column, `streaming`, is the batched server
with every request as the playground sends it, `stream: true, partial_images: 2,
stream_progress: true` (each event read as it comes). For 1, 4,
8 and 16 concurrent clients, each sending requests back to back, all three are measured in the
same round (in alternating order): images/s over the round's wall time, and per-request
latency percentiles.

One JSON object per (clients, server, round), then a summary: medians over rounds, the
throughput ratio batched / one_at_a_time, streaming / batched, and p95 latency at 8 clients
over a lone request. Targets: batching 3x at 8 clients with p95 at most 4x a lone request;
streaming at least 0.9x plain throughput at 8 clients.

    python -m benchmarks.serving [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx

from tests.live import LiveServer, live_server

CLIENTS = (1, 4, 8, 16)
SERVERS = {"batched": (), "one_at_a_time": ("--max-batch", "2")}
COLUMNS = {"batched": "batched", "one_at_a_time": "one_at_a_time", "streaming": "batched"}  # → server
STREAM = {"stream": True, "partial_images": 2, "stream_progress": True}
TARGET_SPEEDUP_AT_8 = 3.0
TARGET_STREAMING_AT_8 = 0.9
TARGET_P95_OVER_LONE_AT_8 = 4.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def client_loop(server: LiveServer, requests: int, seed: int, stream: bool = False) -> list[float]:
    """Send `requests` one after another; the latency of each (to the last event, streamed)."""
    latencies = []
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for i in range(requests):
            body = {"prompt": "a red circle", "seed": seed * 1000 + i, **(STREAM if stream else {})}
            started = time.perf_counter()
            with client.stream("POST", "/v1/images/generations", json=body) as response:
                response.raise_for_status()
                events = sum(line.startswith("event: image_") for line in response.iter_lines())
            latencies.append(time.perf_counter() - started)
            if stream and events != 3:  # two partial images and the completed one (and progress)
                raise RuntimeError(f"{events} image events, not 3")
    return latencies


def measure(server: LiveServer, clients: int, per_client: int, stream: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda c: client_loop(server, per_client, c, stream), range(clients)))
    return summary(runs, time.perf_counter() - started)


def summary(runs: list[list[float]], wall: float) -> dict[str, Any]:
    """Images, wall time, images/s and latency percentiles of the clients' `runs` (latencies)."""
    latencies = [seconds for run in runs for seconds in run]
    return {
        "images": len(latencies),
        "wall_s": round(wall, 3),
        "images_per_s": round(len(latencies) / wall, 3),
        "p50_s": round(percentile(latencies, 0.5), 3),
        "p95_s": round(percentile(latencies, 0.95), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round of 1 request per client, not 3 of 3")
    args = parser.parse_args(argv)
    rounds, per_client = (1, 1) if args.quick else (3, 3)

    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        servers = {name: stack.enter_context(live_server(*flags)) for name, flags in SERVERS.items()}
        for server in servers.values():
            measure(server, 2, 1)  # warm-up
        for clients in CLIENTS:
            for round_ in range(rounds):
                order = list(COLUMNS) if round_ % 2 == 0 else list(reversed(COLUMNS))
                for name in order:
                    server = servers[COLUMNS[name]]
                    row = {"clients": clients, "server": name, "round": round_}
                    before = server.stats()["engine"]["batch_rows"]
                    row |= measure(server, clients, per_client, stream=name == "streaming")
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
            key: median(clients, server, key) for key in ("images_per_s", "p50_s", "p95_s")
        }
        for clients in CLIENTS
        for server in COLUMNS
    }
    speedups = {
        clients: round(
            median(clients, "batched", "images_per_s") / median(clients, "one_at_a_time", "images_per_s"), 3
        )
        for clients in CLIENTS
    }
    streaming = {
        clients: round(
            median(clients, "streaming", "images_per_s") / median(clients, "batched", "images_per_s"), 3
        )
        for clients in CLIENTS
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
        "lone_request_p50_s": lone,
        "p95_at_8_over_lone": p95_ratio,
        "targets": {
            "speedup_at_8": TARGET_SPEEDUP_AT_8,
            "p95_at_8_over_lone": TARGET_P95_OVER_LONE_AT_8,
            "streaming_over_plain_at_8": TARGET_STREAMING_AT_8,
        },
        "meets_target": speedups[8] >= TARGET_SPEEDUP_AT_8
        and p95_ratio <= TARGET_P95_OVER_LONE_AT_8
        and streaming[8] >= TARGET_STREAMING_AT_8,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
