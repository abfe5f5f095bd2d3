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

    python -m benchmarks.serving.throughput [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import ExitStack
from typing import Any

from benchmarks.serving.clients import EDIT_STEPS, STEPS, at_once, client_loop, summary
from tests.support.live import LiveServer, live_server

CLIENTS = (1, 4, 8, 16)
SERVERS = {"batched": (), "one_at_a_time": ("--max-batch", "2")}
COLUMNS = {  # → server
    "batched": "batched",
    "one_at_a_time": "one_at_a_time",
    "streaming": "batched",
    "mixed": "batched",
}
TARGET_SPEEDUP_AT_8 = 3.0
TARGET_STREAMING_AT_8 = 0.9
TARGET_MIXED_AT_8 = 0.9
TARGET_P95_OVER_LONE_AT_8 = 4.0


def measure(server: LiveServer, clients: int, per_client: int, column: str = "batched") -> dict[str, Any]:
    """`clients` clients' requests on `server` as `column` sends them (mixed: odd clients edit)."""
    editing = [column == "mixed" and c % 2 == 1 for c in range(clients)]
    runs, wall = at_once(
        clients, lambda c: client_loop(server, per_client, c, column == "streaming", editing[c])
    )
    steps = sum(len(run) * (EDIT_STEPS if edit else STEPS) for run, edit in zip(runs, editing, strict=True))
    return summary(runs, wall, steps)


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
