"""Fairness between API keys costs no throughput: three keys flooding 6 requests each finish
within 1.1x the wall time of one key sending all 18, on the same server in the same run, and a
lone key's request sent once the floods fill the step still finishes before each flood's 5th.

One real server (`python -m server serve`, the built-in model, one step loop: `--parallel off
--threads 1`, which also keeps the benchmark off the other core) with four API keys. Each round
runs, in alternating order, `one_key` (one key sends 18 requests at once) and `three_keys` (three
keys send 6 each at once), then `with_lone` (the three floods again, and a fourth key's request
once 6 of their jobs are admitted). Every request is "a red circle" at 25 steps. Wall time runs
from the first request sent to the last answer; `mean_batch_rows` is the rows per denoiser call.

On a CPU a step's time grows about in proportion to its rows, so the wall-time ratio barely
tells a full step from a capped one (the old equal-share line, 12 of 16 rows for three keys,
met 1.1x here too); `mean_batch_rows` shows the rows filled. On a GPU, where a step of 12 rows
takes about as long as one of 16, the wall time shows it.

One JSON object per (way, round), then a summary: the median wall time per way, their ratio
three_keys / one_key and `meets_target` (that ratio at most 1.1, from the medians printed), and
whether the lone request beat each flood's 5th answer in every round.

    python -m benchmarks.serving.fairness [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving.clients import STEPS, at_once, percentile
from tests.support.live import LiveServer, live_server
from tests.support.waiting import wait_until

FLOODS = ("a", "b", "c")
KEYS = {name: f"sk-bench-{name}-0123456789" for name in (*FLOODS, "lone", "admin")}
REQUESTS = 18
TARGET_RATIO = 1.1


def stats(server: LiveServer) -> dict[str, Any]:
    """/v1/stats as the admin key sees it: every key's jobs."""
    headers = {"authorization": f"Bearer {KEYS['admin']}"}
    return httpx.get(f"{server.url}/v1/stats", headers=headers, timeout=30).json()["engine"]


def send(server: LiveServer, key: str, seed: int) -> tuple[str, float, float]:
    """One request of `key`: (key, seconds it took, time.monotonic() of its answer)."""
    body = {"prompt": "a red circle", "seed": seed, "num_inference_steps": STEPS}
    started = time.perf_counter()
    with httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=600
    ) as http:
        answer = http.post("/v1/images/generations", json=body)
    answer.raise_for_status()
    return key, time.perf_counter() - started, time.monotonic()


def flood(server: LiveServer, keys: tuple[str, ...]) -> tuple[list[tuple[str, float, float]], float]:
    """REQUESTS requests at once, shared evenly by `keys`: their answers and the wall seconds."""
    return at_once(REQUESTS, lambda i: send(server, keys[i % len(keys)], i))


def batches(server: LiveServer, before: dict[str, int]) -> dict[str, float]:
    """The largest step and the mean rows per step since `before` (/v1/stats' batch_rows)."""
    after = stats(server)["batch_rows"]
    calls = {int(rows): n - before.get(rows, 0) for rows, n in after.items() if n > before.get(rows, 0)}
    mean = sum(rows * n for rows, n in calls.items()) / sum(calls.values())
    return {"largest_batch_rows": max(calls), "mean_batch_rows": round(mean, 2)}


def with_lone(server: LiveServer) -> dict[str, Any]:
    """The three floods, and the lone key's request once they fill the step: did it beat each
    flood's 5th answer?"""
    with ThreadPoolExecutor(1) as pool:
        floods = pool.submit(flood, server, FLOODS)
        # 6 jobs running: two per flood (an equal-share cap, the old line, never ran more)
        wait_until(lambda: stats(server)["active_jobs"] >= 6, 120, "the floods filling the step")
        _, lone_s, lone_at = send(server, "lone", 999)
        answers, _ = floods.result()
    fifth = {key: sorted(t for k, _, t in answers if k == key)[4] for key in FLOODS}
    return {"lone_s": round(lone_s, 3), "lone_before_each_fifth": all(lone_at < t for t in fifth.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round, not 3")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else 3

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        keys, admins = Path(folder) / "keys", Path(folder) / "admins"
        keys.write_text("".join(f"{KEYS[name]}\n" for name in (*FLOODS, "lone")))
        admins.write_text(f"{KEYS['admin']}\n")
        keyed = ("--api-key-file", str(keys), "--admin-key-file", str(admins))
        flags = (*keyed, "--parallel", "off", "--threads", "1")  # one step loop, one core
        with live_server(*flags) as server:
            at_once(2, lambda i: send(server, FLOODS[i], i))  # warm-up
            for round_ in range(rounds):
                ways = {"one_key": FLOODS[:1], "three_keys": FLOODS}
                for way in list(ways) if round_ % 2 == 0 else list(reversed(ways)):
                    before = stats(server)["batch_rows"]
                    answers, wall = flood(server, ways[way])
                    row = {
                        "way": way,
                        "round": round_,
                        "requests": len(answers),
                        "wall_s": round(wall, 3),
                        "p50_s": round(percentile([s for _, s, _ in answers], 0.5), 3),
                    } | batches(server, before)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                row = {"way": "with_lone", "round": round_, **with_lone(server)}
                rows.append(row)
                print(json.dumps(row), flush=True)

    medians = {
        way: round(statistics.median(r["wall_s"] for r in rows if r["way"] == way), 3)
        for way in ("one_key", "three_keys")
    }
    ratio = round(medians["three_keys"] / medians["one_key"], 3)
    summary = {
        "summary": True,
        "rounds": rounds,
        "median_wall_s": medians,
        "three_keys_over_one_key": ratio,
        "target_ratio": TARGET_RATIO,
        "lone_before_each_fifth_every_round": all(
            r["lone_before_each_fifth"] for r in rows if r["way"] == "with_lone"
        ),
        "meets_target": ratio <= TARGET_RATIO,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
