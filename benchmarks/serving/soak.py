"""A soak of one real server: does it hold its memory, threads and file descriptors under a long
mixed load, and does its activation pool stay under its budget when request shapes keep changing?

One real server (`python -m server serve`, the built-in model, `--max-steps 10`, `--pool-budget
12MiB`: see DEFAULT_POOL_BUDGET) is warmed up on every shape of the mix, then:

1. soak: `--requests` generations (default 600) from `--clients` concurrent clients (default 6,
   httpx, one thread each, requests back to back) drawn from a fixed mix: sizes from 64, 96
   and 128 px a side, n 1 or 2, 2 to 4 steps. Measured: requests served, failures by status,
   p50/p95 latency, and the server process's RSS (VmRSS), pool bytes (GET /v1/stats), threads
   (/proc/PID/task) and open files (/proc/PID/fd) after the warm-up and at the end;
2. churn: 40 distinct sizes (multiples of 8 a side, within the model's 128x128 pixel limit),
   one request each, reading the pool after each: its idle bytes must stay within the budget.

One JSON object per phase, then a summary: rss_growth_ratio ((end - start) / start), the
pool's largest idle bytes during the churn against the budget, threads and fds at start and
end, failures; meets_target = growth < 5%, pool within budget, threads and fds flat (within
a few) and 0 failures.

    python -m benchmarks.serving.soak [--quick]

The soak of video jobs is `benchmarks.serving.video_soak`.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from typing import Any

import httpx

from benchmarks.serving.clients import percentile
from benchmarks.serving.probes import MIB, pool_view, settled
from server.engine.hardware.devices import parse_size
from tests.support.live import LiveServer, live_server

# The pool keeps ~11 MiB idle once the whole mix has run (its buffers are the requests' inputs,
# latents and images, not the UNet's activations), so a budget just above that lets the soak run
# warm while the churn's new shapes must evict to stay within it (64 MiB would never be reached).
DEFAULT_POOL_BUDGET = "12MiB"
SIDES = (64, 96, 128)
MIX = [  # (width, height, n, steps): every shape of the soak
    (width, height, n, steps)
    for (width, height), n, steps in product(product(SIDES, SIDES), (1, 2), (2, 3, 4))
    if width * height <= 128 * 128
]
CHURN_SIZES = list(product(range(64, 129, 8), repeat=2))[1::2][:40]  # 40 distinct (width, height)
TARGET_RSS_GROWTH = 0.05
FLAT = 3  # threads and fds may differ by this many between start and end


def body(shape: tuple[int, int, int, int], seed: int) -> dict[str, Any]:
    width, height, n, steps = shape
    return {
        "prompt": "a green triangle",
        "size": f"{width}x{height}",
        "n": n,
        "num_inference_steps": steps,
        "seed": seed,
    }


def load(server: LiveServer, shapes: list[tuple[int, int, int, int]], clients: int) -> dict[str, Any]:
    """Send `shapes` as requests from `clients` threads taking the next one as they finish; the
    latencies and statuses."""
    lock, queue = threading.Lock(), list(enumerate(shapes))
    latencies: list[float] = []
    statuses: Counter = Counter()

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    seed, shape = queue.pop()
                started = time.perf_counter()
                try:
                    status = str(http.post("/v1/images/generations", json=body(shape, seed)).status_code)
                except httpx.HTTPError as err:
                    status = f"error:{type(err).__name__}"
                with lock:
                    latencies.append(time.perf_counter() - started)
                    statuses[status] += 1

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    wall = time.perf_counter() - started
    return {
        "requests": len(shapes),
        "images": sum(shape[2] for shape in shapes),
        "served": statuses.get("200", 0),
        "failures": {status: count for status, count in statuses.items() if status != "200"},
        "wall_s": round(wall, 1),
        "requests_per_s": round(len(shapes) / wall, 2),
        "p50_s": round(percentile(latencies, 0.5), 3),
        "p95_s": round(percentile(latencies, 0.95), 3),
    }


def churn(server: LiveServer, sizes: list[tuple[int, int]], budget: int) -> dict[str, Any]:
    """One request per size, one at a time; the pool read after each."""
    statuses: Counter = Counter()
    idle_max, pooled_max = 0, 0
    with httpx.Client(base_url=server.url, timeout=300) as http:
        for seed, (width, height) in enumerate(sizes):
            response = http.post("/v1/images/generations", json=body((width, height, 1, 2), seed))
            statuses[str(response.status_code)] += 1
            pool = pool_view(server)
            idle_max = max(idle_max, pool["idle_max_device"])
            pooled_max = max(pooled_max, pool["pooled"])
    return {
        "sizes": len(sizes),
        "served": statuses.get("200", 0),
        "failures": {status: count for status, count in statuses.items() if status != "200"},
        "pool_idle_max": idle_max,
        "pool_pooled_max": pooled_max,
        "pool_budget": budget,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="60 requests and 10 churn sizes, to check it runs"
    )
    parser.add_argument("--requests", type=int, default=600, help="generations in the soak (default 600)")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    parser.add_argument(
        "--pool-budget",
        default=DEFAULT_POOL_BUDGET,
        help=f"the server's --pool-budget, SIZE or cpu=SIZE (default {DEFAULT_POOL_BUDGET})",
    )
    args = parser.parse_args(argv)
    if args.videos:
        from benchmarks import video_soak

        args.clients = args.clients or 3
        return video_soak.main(args)
    args.clients = args.clients or 6
    budget = min(parse_size(size.rpartition("=")[2]) for size in args.pool_budget.split(","))
    flags = ("--max-steps", "10", "--pool-budget", args.pool_budget)
    requests, sizes = (60, CHURN_SIZES[:10]) if args.quick else (args.requests, CHURN_SIZES)
    shuffle = random.Random(0)

    with live_server(*flags) as server:
        warm_up = load(server, MIX * 2, args.clients)  # every shape, twice, at the soak's concurrency
        print(json.dumps({"phase": "warm_up", **warm_up}), flush=True)
        start = settled(server)
        soak = load(server, [shuffle.choice(MIX) for _ in range(requests)], args.clients)
        end = settled(server)
        print(json.dumps({"phase": "soak", **soak, "start": start, "end": end}), flush=True)
        churned = churn(server, sizes, budget)
        after_churn = settled(server)
        print(json.dumps({"phase": "churn", **churned, "after": after_churn}), flush=True)

    growth = (end["rss_bytes"] - start["rss_bytes"]) / start["rss_bytes"]
    failures = sum(soak["failures"].values()) + sum(churned["failures"].values())
    threads_flat = abs(end["threads"] - start["threads"]) <= FLAT
    fds_flat = abs(end["fds"] - start["fds"]) <= FLAT
    pool_within = churned["pool_idle_max"] <= budget
    summary = {
        "summary": True,
        "requests": soak["requests"],
        "images": soak["images"],
        "served": soak["served"],
        "failures": {"soak": soak["failures"], "churn": churned["failures"]},
        "p50_s": soak["p50_s"],
        "p95_s": soak["p95_s"],
        "rss_start_mib": round(start["rss_bytes"] / MIB, 1),
        "rss_end_mib": round(end["rss_bytes"] / MIB, 1),
        "rss_after_churn_mib": round(after_churn["rss_bytes"] / MIB, 1),
        "rss_growth_ratio": round(growth, 4),
        "pool_start": start["pool"],
        "pool_end": end["pool"],
        "churn_pool_idle_max_mib": round(churned["pool_idle_max"] / MIB, 2),
        "churn_pool_evictions": after_churn["pool"]["evictions"] - end["pool"]["evictions"],
        "pool_budget_mib": round(budget / MIB, 2),
        "threads": {"start": start["threads"], "end": end["threads"], "after_churn": after_churn["threads"]},
        "fds": {"start": start["fds"], "end": end["fds"], "after_churn": after_churn["fds"]},
        "targets": {"rss_growth_below": TARGET_RSS_GROWTH, "threads_fds_within": FLAT, "failures": 0},
        "meets_target": growth < TARGET_RSS_GROWTH
        and pool_within
        and threads_flat
        and fds_flat
        and failures == 0,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
