"""One CPU core, two thread counts: what `--threads` (default: the CPU quota) buys.

Two real servers are started under `taskset -c 0` (one core): one with its default thread
count (the quota: 1), one forced to `--threads 2` (torch's own default would be the host's 2
cores). Each serves lone requests of the built-in model at its recommended settings, in
alternating rounds; the summary compares medians of the same rounds.

    python -m benchmarks.parallel.thread_count [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics

from benchmarks.serving.clients import lone
from tests.support.live import live_server

BODY = {"prompt": "a red circle", "size": "64x64", "seed": 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 11")
    args = parser.parse_args(argv)
    if shutil.which("taskset") is None:
        print(json.dumps({"summary": True, "error": "taskset (util-linux) is not installed"}))
        return 1
    rounds = 3 if args.quick else 11
    pinned = ("taskset", "-c", "0")
    with (
        live_server(prefix=pinned) as quota,
        live_server("--threads", "2", prefix=pinned) as forced,
    ):
        servers = {"quota": quota, "threads_2": forced}
        threads = {name: s.stats()["threads"] for name, s in servers.items()}
        times: dict[str, list[float]] = {name: [] for name in servers}
        for server in servers.values():  # warm-up
            lone(server, BODY)
        for round_ in range(rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                times[name].append(lone(servers[name], BODY))
            print(json.dumps({"round": round_, **{f"{n}_s": round(t[-1], 4) for n, t in times.items()}}))
    median = {name: statistics.median(values) for name, values in times.items()}
    ratios = [q / f for q, f in zip(times["quota"], times["threads_2"], strict=True)]
    print(
        json.dumps(
            {
                "summary": True,
                "rounds": rounds,
                "cores": 1,
                "threads": threads,
                "quota_median_s": round(median["quota"], 4),
                "threads_2_median_s": round(median["threads_2"], 4),
                "ratio_median": round(statistics.median(ratios), 4),  # quota / threads_2, paired rounds
                "meets_target": threads["quota"] == 1 and statistics.median(ratios) <= 1.0,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
