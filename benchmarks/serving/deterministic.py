"""What `deterministic: true` costs (issue 22): a deterministic request runs its rows in calls of
its own, so under load it shares no step with others.

One real server (`python -m server serve`, the built-in model, its recommended steps and
guidance, default settings) takes 8 concurrent clients, each sending requests back to back,
in rounds that alternate between plain requests and `deterministic: true` ones (the same
prompts and seeds). Per round: images/s over its wall time and p50 latency; then medians over
rounds and the ratio deterministic / plain, from the same run. There is no target: the
figure is what the README quotes as the option's price.

    python -m benchmarks.serving.deterministic [--quick]
"""

from __future__ import annotations

import argparse
import json

from benchmarks.serving.clients import at_once, client_loop, medians, rate
from tests.support.live import LiveServer, live_server

CLIENTS = 8


def round_of(server: LiveServer, per_client: int, deterministic: bool, seed: int) -> dict[str, float]:
    fields = {"deterministic": deterministic}
    return rate(*at_once(CLIENTS, lambda c: client_loop(server, per_client, seed + c, fields=fields)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds of each, 2 requests a client")
    args = parser.parse_args(argv)
    rounds, per_client = (2, 2) if args.quick else (4, 3)
    table: dict[str, list[dict[str, float]]] = {"plain": [], "deterministic": []}
    with live_server() as server:
        client_loop(server, 1, 0, fields={"deterministic": False})  # warm-up
        for round_ in range(rounds):
            kinds = ["plain", "deterministic"] if round_ % 2 == 0 else ["deterministic", "plain"]
            for kind in kinds:
                row = round_of(server, per_client, kind == "deterministic", 100 * round_)
                table[kind].append(row)
                print(json.dumps({"round": round_, "kind": kind, "clients": CLIENTS, **row}))
    median = medians(table)
    ratio = median["deterministic"]["images_per_s"] / median["plain"]["images_per_s"]
    print(
        json.dumps(
            {
                "summary": True,
                "rounds": rounds,
                "clients": CLIENTS,
                "medians": median,
                "deterministic_over_plain_images_per_s": round(ratio, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
