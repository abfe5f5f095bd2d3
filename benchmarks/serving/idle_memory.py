"""Idle memory comes back (issue 22): after a burst of distinct sizes, does an idle server return
its pool and its heap to where they were before the burst?

One real server (`python -m server serve`, the built-in model, default settings: housekeeping
every 30 s of idleness, pooled buffers idle for 60 s dropped, then glibc's trim; `--compile
auto`, whose background compile it waits for first) is warmed up with one request of the native
size; its RSS (VmRSS) and pool are read (`pre_burst`). Then the burst: 40 distinct sizes
(benchmarks.serving.soak's churn: multiples of 8 a side within the model's 128² limit), n 1 or 2, from 4
concurrent clients. Then nothing for `--idle-s` seconds (default 120), reading RSS and the pool
every 10 s.

Target (`meets_target`): at the end of the idle period the pool holds no idle bytes (its idle
floor: nothing is in use either) and RSS is within 10% of `pre_burst`, both from the same run.

    python -m benchmarks.serving.idle_memory [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks.serving.clients import compiled_after
from benchmarks.serving.probes import MIB, pool_view, process_view, settled
from benchmarks.serving.soak import CHURN_SIZES, load
from tests.support.live import LiveServer, live_server

TARGET_RSS_RATIO = 1.10
CLIENTS = 4
READ_EVERY_S = 10


def reading(server: LiveServer, since: float) -> dict[str, Any]:
    rss = process_view(server.process.pid)["rss_bytes"]
    return {
        "t_s": round(time.monotonic() - since, 1),
        "rss_mib": round(rss / MIB, 1),
        "pool": pool_view(server),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="10 sizes instead of 40 (the idle wait is the same)"
    )
    parser.add_argument("--idle-s", type=float, default=120.0, help="how long to stay idle after the burst")
    args = parser.parse_args(argv)
    sizes = CHURN_SIZES[:10] if args.quick else CHURN_SIZES
    with live_server(startup_deadline_s=600) as server:
        compiled = compiled_after(server, time.perf_counter())  # the default compiles in the background
        print(json.dumps({"phase": "compiled", **compiled}))
        load(server, [(64, 64, 1, 4)], 1)  # warm: the native size once
        pre = settled(server)
        print(
            json.dumps(
                {"phase": "pre_burst", "rss_mib": round(pre["rss_bytes"] / MIB, 1), "pool": pre["pool"]}
            )
        )
        shapes = [(w, h, 1 + i % 2, 4) for i, (w, h) in enumerate(sizes)]
        outcome = load(server, shapes, CLIENTS)
        burst = settled(server)
        print(
            json.dumps(
                {
                    "phase": "after_burst",
                    "sizes": len(sizes),
                    "served": outcome["served"],
                    "failures": outcome["failures"],
                    "rss_mib": round(burst["rss_bytes"] / MIB, 1),
                    "pool": burst["pool"],
                }
            )
        )
        idle_from = time.monotonic()
        last = reading(server, idle_from)
        while time.monotonic() - idle_from < args.idle_s:  # the point is to stay idle: a timed wait
            time.sleep(min(READ_EVERY_S, max(0.0, args.idle_s - (time.monotonic() - idle_from))))
            last = reading(server, idle_from)
            print(json.dumps({"phase": "idle", **last}))
        given_back = [line for line in server.log if "given back" in line]
    ratio = last["rss_mib"] * MIB / pre["rss_bytes"]
    checks = {
        "pool at its idle floor (0 idle bytes)": last["pool"]["idle"] == 0 and last["pool"]["in_use"] == 0,
        f"RSS within {TARGET_RSS_RATIO:.2f}x of pre-burst": ratio <= TARGET_RSS_RATIO,
    }
    print(
        json.dumps(
            {
                "summary": True,
                "idle_s": args.idle_s,
                "rss_mib": {
                    "pre_burst": round(pre["rss_bytes"] / MIB, 1),
                    "after_burst": round(burst["rss_bytes"] / MIB, 1),
                    "after_idle": last["rss_mib"],
                },
                "rss_after_idle_over_pre_burst": round(ratio, 3),
                "pool_idle_bytes": {"after_burst": burst["pool"]["idle"], "after_idle": last["pool"]["idle"]},
                "housekeeping_log": [line.strip() for line in given_back],
                "checks": checks,
                "meets_target": all(checks.values()),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
