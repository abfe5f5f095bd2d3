"""Priority classes (issue 73): a batch of background images costs interactive requests little,
and still completes once they stop. Target: with 40 background images running and 4 clients
sending interactive requests, the interactive p95 latency at most 1.15x the same load without
the batch, and every background image answered after the interactive load stops.

One real server (`python -m server serve`, the built-in model, one step loop: `--parallel off
--threads 1`, which also keeps the benchmark's clients off its core), measured once its
background compile has ended. Each round runs, in alternating order, `without` (4 closed-loop
clients, each sending "a red circle" at 25 steps back to back for the window) and `with` (first a
batch of 40 such images handed over through OpenAI's Batch API with the openai SDK unchanged,
`client.files.create` then `client.batches.create`; then, once its rows are stepping, the same 4
clients for the same window). A request's latency is its send to its answer; the window's
requests are those sent before it closed. `background_rows_in_window` is the rows the batch
stepped while the clients ran (/v1/stats' priorities), `batch_drain_s` the seconds from the
clients' last answer to the batch seen `completed` (polled at most 0.2 s apart; negative: the
batch was done while they ran), `batch_lines_completed` its output file's 200 lines.

One JSON object per (way, round), then a summary: per way the median over rounds of the p95,
each round's ratio with / without (paired: same server, back to back), their median against the
target, and whether every round's batch completed.

    python -m benchmarks.serving.priority [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx
import openai

from benchmarks.serving.clients import STEPS, at_once, compiled_after, percentile
from tests.support.live import LiveServer, live_server
from tests.support.waiting import wait_until

CLIENTS = 4
BATCH = 40  # background images
RUNNING = {"validating", "in_progress", "finalizing"}
TARGET_RATIO = 1.15


def priorities(server: LiveServer) -> dict[str, dict[str, int]]:
    return httpx.get(f"{server.url}/v1/stats", timeout=30).json()["engine"]["priorities"]


def post(http: httpx.Client, seed: int, priority: str) -> float:
    """One request's seconds, to its answer."""
    body = {"prompt": "a red circle", "seed": seed, "num_inference_steps": STEPS, "priority": priority}
    started = time.perf_counter()
    http.post("/v1/images/generations", json=body).raise_for_status()
    return time.perf_counter() - started


def interactive(server: LiveServer, client: int, until: float) -> list[float]:
    """A closed-loop client: requests back to back until `until` (time.monotonic()); their latencies."""
    latencies = []
    with httpx.Client(base_url=server.url, timeout=600) as http:
        while time.monotonic() < until:
            latencies.append(post(http, client * 1000 + len(latencies), "interactive"))
    return latencies


def hand_over(client: openai.OpenAI, round_: int) -> str:
    """A batch of BATCH images (seeds of this round's), as a user hands one over; its id."""
    seeds = [100_000 * (round_ + 1) + i for i in range(BATCH)]
    lines = [
        {
            "custom_id": f"image-{seed}",
            "method": "POST",
            "url": "/v1/images/generations",
            "body": {"prompt": "a red circle", "seed": seed, "num_inference_steps": STEPS},
        }
        for seed in seeds
    ]
    jsonl = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("images.jsonl", jsonl), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/images/generations", completion_window="24h"
    )
    return batch.id


def completed(client: openai.OpenAI, batch_id: str) -> tuple[float, int]:
    """Wait for the batch to end: the time.monotonic() it was seen completed, its 200 lines."""
    batch = wait_until(
        lambda: b if (b := client.batches.retrieve(batch_id)).status not in RUNNING else None,
        1800,
        f"batch {batch_id} ending",
    )
    seen = time.monotonic()
    if batch.status != "completed" or batch.output_file_id is None:
        return seen, 0
    output = client.files.content(batch.output_file_id).read().decode().splitlines()
    return seen, sum(json.loads(line)["response"]["status_code"] == 200 for line in output)


def measure(server: LiveServer, window_s: float, round_: int, with_batch: bool) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    if with_batch:
        batch_id = hand_over(client, round_)
        wait_until(lambda: priorities(server)["background"]["active_rows"] > 0, 120, "the batch stepping")
    before = priorities(server)["background"]["rows_total"]
    until = time.monotonic() + window_s
    runs, _ = at_once(CLIENTS, lambda c: interactive(server, c, until))
    stopped = time.monotonic()
    in_window = priorities(server)["background"]["rows_total"] - before
    latencies = [s for run in runs for s in run]
    row: dict[str, Any] = {
        "requests": len(latencies),
        "p50_s": round(percentile(latencies, 0.5), 3),
        "p95_s": round(percentile(latencies, 0.95), 3),
    }
    if with_batch:
        seen, lines = completed(client, batch_id)
        row |= {
            "background_rows_in_window": in_window,
            "batch_lines_completed": lines,
            "batch_completed": lines == BATCH,
            "batch_drain_s": round(seen - stopped, 3),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round of a 20 s window, not 3 of 40 s")
    args = parser.parse_args(argv)
    rounds, window_s = (1, 20.0) if args.quick else (3, 40.0)

    rows: list[dict[str, Any]] = []
    with live_server("--parallel", "off", "--threads", "1") as server:
        compiled_after(server, time.perf_counter())  # its background compile done: steady calls
        at_once(CLIENTS, lambda c: interactive(server, c, time.monotonic() + 5))  # warm-up
        for round_ in range(rounds):
            ways = ["without", "with"] if round_ % 2 == 0 else ["with", "without"]
            for way in ways:
                row = {"way": way, "round": round_} | measure(server, window_s, round_, way == "with")
                rows.append(row)
                print(json.dumps(row), flush=True)

    def p95s(way: str) -> list[float]:
        return [r["p95_s"] for r in rows if r["way"] == way]

    paired = [round(w / wo, 3) for w, wo in zip(p95s("with"), p95s("without"), strict=True)]
    ratio = statistics.median(paired)
    completed = all(r["batch_completed"] for r in rows if r["way"] == "with")
    summary = {
        "summary": True,
        "rounds": rounds,
        "window_s": window_s,
        "median_p95_s": {way: round(statistics.median(p95s(way)), 3) for way in ("without", "with")},
        "p95_with_over_without": paired,
        "median_ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "batch_completed_every_round": completed,
        "meets_target": ratio <= TARGET_RATIO and completed,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
