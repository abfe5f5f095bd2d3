"""A fresh server's first requests against its warm ones: what a client meets right after a
replica turns ready (a rollout, a scale-out).

Each round starts a server of its own at the defaults (`--compile auto` with an empty cache
directory: its compile runs in the background, giving way to the step loops) and, the moment
/readyz turns 200, sends lone requests one after another (the built-in model, 60 steps, as the
issue that asked for this measured): the first, then WARM_AFTER more, then WARM more whose
median is the warm latency. The same rounds at `--compile off` say what a first request costs
with no compile beside it (the lanes' first calls: oneDNN's primitives for each shape, each
lane's OpenMP team, the pool's first rents). Target: the first lone request at most 2x the warm
one, medians over rounds; the compile's state at each round's end is printed (still compiling:
it ran beside every request).

One JSON object per round, then a summary whose `meets_target` is computed from them. What a
CPU run cannot show: a GPU's first calls (cuDNN's autotuning, CUDA's lazy module loading).

    python -m benchmarks.serving.first_request [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import httpx

from benchmarks.peers.diffusers_context_parallel import cpu_model
from benchmarks.peers.openvino_unet import cpu_flags
from tests.support.live import live_server

TARGET = 2.0
STEPS = 60
WARM_AFTER = 2  # requests between the first and the warm ones: each lane's first call
WARM = 3


def lone(url: str, seed: int) -> float:
    body = {"prompt": "a red circle", "num_inference_steps": STEPS, "seed": seed}
    started = time.perf_counter()
    answer = httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)
    answer.raise_for_status()
    return time.perf_counter() - started


def one_round(compile_mode: str, index: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        args = ("--compile", compile_mode, "--cache-dir", cache)
        with live_server(*args, env={"DIFFSHARD_COMPILE": compile_mode}) as server:
            times = [lone(server.url, seed) for seed in range(1 + WARM_AFTER + WARM)]
            compiled = server.stats()["compile"]
    warm = statistics.median(times[1 + WARM_AFTER :])
    record = {
        "compile": compile_mode,
        "round": index,
        "first_s": round(times[0], 3),
        "then_s": [round(t, 3) for t in times[1 : 1 + WARM_AFTER]],
        "warm_s": round(warm, 3),
        "first_over_warm": round(times[0] / warm, 3),
        "compile_state": compiled["state"],  # "compiling": all along beside the requests
    }
    print(json.dumps(record), flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds each")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per mode (default 3)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    records: dict[str, list[dict[str, Any]]] = {"auto": [], "off": []}
    for index in range(rounds):  # paired: each round a fresh server of each
        for mode in records:
            records[mode].append(one_round(mode, index))
    figures = {
        mode: {
            "first_s": round(statistics.median(r["first_s"] for r in rs), 3),
            "warm_s": round(statistics.median(r["warm_s"] for r in rs), 3),
            "first_over_warm": round(statistics.median(r["first_over_warm"] for r in rs), 3),
        }
        for mode, rs in records.items()
    }
    print(
        json.dumps(
            {
                "summary": True,
                "meets_target": figures["auto"]["first_over_warm"] <= TARGET,
                "target": f"first lone request <= {TARGET}x a warm one, at the defaults (--compile auto)",
                "rounds": rounds,
                "steps": STEPS,
                **figures,
                "cpu": cpu_model(),
                "cpu_flags": cpu_flags(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
