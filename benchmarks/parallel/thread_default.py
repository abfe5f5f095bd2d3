"""The thread default (issue 21): what the planner now picks for CPU workers against the fixed
alternatives, over real HTTP, and how fast several devices become ready.

Three servers of the built-in model (its recommended 25 steps and guidance) run side by side:

- `old_default`: `--devices cpu --threads <quota>`: one worker with all the quota's threads,
  the default before the planner chose threads;
- `one_thread_lanes`: `--devices cpu,cpu --parallel replicas --threads <quota>`: a lane per core,
  one thread each (a lone request runs on one of them: for this dispatch-bound model its
  plan predicts splitting rows slower; `benchmarks.parallel.lone_split` shows a model where it pays);
- `new_default`: no flags: the planner's choice (the plan's headline is printed).

For 1 and 8 concurrent clients, each sending requests back to back, all three are measured in
the same round, in rotating order (benchmarks.serving.clients' client loop): images/s over the round's
wall time, p50/p95 latency. Then readiness: `serve` with `--devices cpu` and with
`--devices cpu,cpu` (default parallel mode), started alternately, each timed from process start
to `/readyz` answering 200, with the calibration already cached (a first start warms it).

Targets (`meets_target`), from medians over rounds: the new default serves ≥ 0.95× the best
fixed alternative's images/s at 1 and at 8 clients; a lone request on `one_thread_lanes` takes at
most 1.1× the new default's p50 latency (CPU workers share the cores: not slower, not faster);
`--devices cpu,cpu` is ready within 1.5× the time of `--devices cpu`.

    python -m benchmarks.parallel.thread_default [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import ExitStack
from typing import Any

import httpx

from benchmarks.serving.clients import at_once, client_loop, summary
from server.engine.hardware.threads import cpu_quota
from tests.support.live import LiveServer, live_server

CLIENTS = (1, 8)
TARGET_SHARE = 0.95
TARGET_LONE = 1.1
TARGET_READY = 1.5


def servers(quota: int) -> dict[str, tuple[str, ...]]:
    return {
        "old_default": ("--devices", "cpu", "--threads", str(quota)),
        "one_thread_lanes": ("--devices", "cpu,cpu", "--parallel", "replicas", "--threads", str(quota)),
        "new_default": (),
    }


def measure(server: LiveServer, clients: int, per_client: int, seed: int) -> dict[str, Any]:
    return summary(*at_once(clients, lambda c: client_loop(server, per_client, seed + c)))


def ready_seconds(*args: str) -> float:
    started = time.perf_counter()
    with live_server(*args):  # returns once /readyz answers 200
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round instead of 3")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else 3
    quota = cpu_quota()
    table: dict[int, dict[str, list[dict[str, Any]]]] = {c: {} for c in CLIENTS}
    with ExitStack() as stack:
        running = {name: stack.enter_context(live_server(*flags)) for name, flags in servers(quota).items()}
        plans = {name: httpx.get(f"{s.url}/v1/shards").json()["parallel"] for name, s in running.items()}
        print(
            json.dumps(
                {
                    "quota": quota,
                    "plans": {
                        n: {k: p[k] for k in ("replicas", "lanes", "threads_per_lane")}
                        for n, p in plans.items()
                    },
                }
            )
        )
        for server in running.values():  # warm-up
            client_loop(server, 1, 0)
        for round_ in range(rounds):
            for clients in CLIENTS:
                names = list(running)
                order = names[round_ % len(names) :] + names[: round_ % len(names)]
                for name in order:
                    row = measure(running[name], clients, 2 if clients == 1 else 3, 100 * round_)
                    table[clients].setdefault(name, []).append(row)
                    print(json.dumps({"round": round_, "clients": clients, "server": name, **row}))
    # readiness, the calibration cached by the servers above
    ready: dict[str, list[float]] = {"cpu": [], "cpu,cpu": []}
    for _ in range(rounds + 2):
        for devices in ready:
            ready[devices].append(ready_seconds("--devices", devices))
    ready_median = {d: statistics.median(v) for d, v in ready.items()}
    print(json.dumps({"ready_s": ready}))

    medians = {
        clients: {
            name: {k: statistics.median(r[k] for r in rows) for k in ("images_per_s", "p50_s", "p95_s")}
            for name, rows in by_server.items()
        }
        for clients, by_server in table.items()
    }
    checks = {}
    for clients in CLIENTS:
        m = medians[clients]
        best_fixed = max(m["old_default"]["images_per_s"], m["one_thread_lanes"]["images_per_s"])
        checks[f"new default ≥ {TARGET_SHARE}× the best fixed at {clients} client(s)"] = (
            m["new_default"]["images_per_s"] >= TARGET_SHARE * best_fixed
        )
    lone = medians[1]["one_thread_lanes"]["p50_s"] / medians[1]["new_default"]["p50_s"]
    checks[f"lone request on 2 replicas ≤ {TARGET_LONE}× the default's latency"] = lone <= TARGET_LONE
    ready_ratio = ready_median["cpu,cpu"] / ready_median["cpu"]
    checks[f"cpu,cpu ready within {TARGET_READY}× cpu"] = ready_ratio <= TARGET_READY
    print(
        json.dumps(
            {
                "summary": True,
                "rounds": rounds,
                "quota": quota,
                "images_per_s": {
                    c: {n: round(v["images_per_s"], 3) for n, v in m.items()} for c, m in medians.items()
                },
                "p50_s": {c: {n: round(v["p50_s"], 3) for n, v in m.items()} for c, m in medians.items()},
                "lone_replicas_over_default_p50": round(lone, 3),
                "ready_median_s": {d: round(s, 2) for d, s in ready_median.items()},
                "ready_ratio": round(ready_ratio, 3),
                "checks": checks,
                "meets_target": all(checks.values()),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
