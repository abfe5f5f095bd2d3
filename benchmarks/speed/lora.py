"""LoRA adapters mixed in one batch (issue 23): what serving requests with different adapters
costs, against the same requests without adapters and against serving one adapter at a time.

One real server (`python -m server serve`, the built-in model, its recommended steps and
guidance) serves three random rank-8 adapters on the UNet's attention and the text encoder
(tests/test_lora.py's `random_lora`, seeds 1-3). Each round sends 8 clients × `per_client`
requests three ways, in rotating order:

- `plain`: no adapters;
- `mixed`: client c asks for adapter c mod 3, all at once: rows with different adapters share
  every step;
- `grouped`: the same requests, one adapter's clients at a time (3, 3, then 2 clients), as
  servers that split batches by adapter (or merge one adapter at a time) serve them.

Per way: images/s over the round's wall time and p50 latency; medians over rounds. Target
(`meets_target`): mixed ≥ 0.8× plain images/s, the ratio of medians from the same run.

    python -m benchmarks.speed.lora [--quick]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving.clients import at_once, client_loop, medians, rate
from server.demo import MODEL_DIR
from tests.support.live import LiveServer, live_server
from tests.support.lora import random_lora

CLIENTS = 8
ADAPTERS = ("a", "b", "c")
TARGET = 0.8


def asking(adapter: str | None) -> dict[str, Any]:
    """A request's fields asking for `adapter` at scale 1 (None: none)."""
    return {} if adapter is None else {"lora": {adapter: 1.0}}


def clients_at_once(
    server: LiveServer, adapters: list[str | None], per_client: int, seed: int
) -> list[list[float]]:
    """A client per adapter (None: plain), started together; each client's latencies."""
    runs, _ = at_once(
        len(adapters), lambda c: client_loop(server, per_client, seed + c, fields=asking(adapters[c]))
    )
    return runs


def way(server: LiveServer, name: str, per_client: int, seed: int) -> dict[str, float]:
    started = time.perf_counter()
    if name == "plain":
        runs = clients_at_once(server, [None] * CLIENTS, per_client, seed)
    elif name == "mixed":
        runs = clients_at_once(server, [ADAPTERS[c % 3] for c in range(CLIENTS)], per_client, seed)
    else:  # grouped: one adapter's clients at a time, the wall time over all three groups
        runs = []
        for adapter in ADAPTERS:
            group = [adapter] * sum(1 for c in range(CLIENTS) if ADAPTERS[c % 3] == adapter)
            runs += clients_at_once(server, group, per_client, seed)
    return rate(runs, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round, 1 request a client")
    args = parser.parse_args(argv)
    rounds, per_client = (1, 1) if args.quick else (3, 2)
    ways = ["plain", "mixed", "grouped"]
    table: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp:
        flags = []
        for seed, name in enumerate(ADAPTERS, start=1):
            path = random_lora(MODEL_DIR, Path(tmp) / f"{name}.safetensors", seed, "sd15", rank=8)
            flags += ["--lora", f"{name}={path}"]
        with live_server(*flags) as server:
            client_loop(server, 1, 0, fields=asking("a"))  # warm-up
            for round_ in range(rounds):
                for name in ways[round_ % 3 :] + ways[: round_ % 3]:
                    row = way(server, name, per_client, 100 * round_)
                    table[name].append(row)
                    print(json.dumps({"round": round_, "way": name, "clients": CLIENTS, **row}))
            rows = httpx.get(f"{server.url}/v1/stats", timeout=10).json()["engine"]["batch_rows"]
    median = medians(table)
    mixed_over_plain = median["mixed"]["images_per_s"] / median["plain"]["images_per_s"]
    mixed_over_grouped = median["mixed"]["images_per_s"] / median["grouped"]["images_per_s"]
    print(
        json.dumps(
            {
                "summary": True,
                "rounds": rounds,
                "clients": CLIENTS,
                "medians": median,
                "mixed_over_plain": round(mixed_over_plain, 3),
                "mixed_over_grouped": round(mixed_over_grouped, 3),
                "rows_per_call": rows,
                "meets_target": mixed_over_plain >= TARGET,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
