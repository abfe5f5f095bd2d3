"""Admission by compute: a step's work bounded by `--step-budget` (auto: the knee the planner's
costs predict) against a fixed row cap alone (`--step-budget off`, `--max-batch 16`).

Two real servers of the built-in model side by side (both `--max-pixels 65536`, so 256² images
are allowed; the recommended 25 steps), measured in the same rounds in alternating order: 8
clients sending 64² requests, 8 sending 256² requests, and 8 mixed (even clients 64², odd ones
256²). Per case and server: images/s over the round's wall time and each size's p50/p95
latency. The mixed case shows whether small requests starve (or are slowed) beside large ones.

One JSON object per (case, server, round), then a summary of medians over rounds.

    python -m benchmarks.serving.step_budget [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import ExitStack
from typing import Any

from benchmarks.serving.clients import at_once, client_loop, percentile
from tests.support.live import LiveServer, live_server

CLIENTS = 8
SMALL, LARGE = 64, 256
CASES = {"small": (SMALL, SMALL), "large": (LARGE, LARGE), "mixed": (SMALL, LARGE)}  # even, odd clients
SERVERS = {"fixed_max_batch": ("--step-budget", "off"), "budget": ()}


def run_case(server: LiveServer, sizes: tuple[int, int], per_client: int) -> dict[str, Any]:
    size_of = [sizes[c % 2] for c in range(CLIENTS)]
    runs, wall = at_once(CLIENTS, lambda c: client_loop(server, per_client, c, size=size_of[c]))
    figures: dict[str, Any] = {"images_per_s": round(sum(map(len, runs)) / wall, 3), "wall_s": round(wall, 2)}
    for size in sorted(set(sizes)):
        latencies = [s for run, side in zip(runs, size_of, strict=True) if side == size for s in run]
        figures[f"p50_s_{size}"] = round(percentile(latencies, 0.5), 3)
        figures[f"p95_s_{size}"] = round(percentile(latencies, 0.95), 3)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one round, one request per client")
    args = parser.parse_args(argv)
    rounds, per_client = (1, 1) if args.quick else (3, 2)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(live_server("--max-pixels", str(LARGE * LARGE), *flags))
            for name, flags in SERVERS.items()
        }
        for server in servers.values():  # warm each server's pool at both sizes
            client_loop(server, 1, 99, size=SMALL), client_loop(server, 1, 99, size=LARGE)
        for round_ in range(rounds):
            for case, sizes in CASES.items():
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    figures = run_case(servers[name], sizes, per_client)
                    print(json.dumps({"case": case, "server": name, "round": round_, **figures}), flush=True)
                    results.setdefault((case, name), []).append(figures)
    summary: dict[str, Any] = {"summary": True, "clients": CLIENTS, "rounds": rounds}
    for (case, name), runs in results.items():
        summary.setdefault(case, {})[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    mixed = summary["mixed"]
    summary["mixed_small_p95_budget_over_fixed"] = round(
        mixed["budget"][f"p95_s_{SMALL}"] / mixed["fixed_max_batch"][f"p95_s_{SMALL}"], 3
    )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
