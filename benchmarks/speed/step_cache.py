"""Step caching's speed (issue 27): the same requests with `step_cache` off and with the default
policy (`{"policy": "deep", "interval": 3}`), on one real server, over HTTP.

Two models, each served by `python -m server serve` (step caching off by default: each request
asks for its own):

- `built_in`: the built-in model at its recommended settings (25 steps, guidance 5, 64²);
- `sd15_latent32`: an SD-1.5-architecture UNet at latent 32² (random weights, seed 0; the folder
  `benchmarks.parallel.lone_split` builds), 25 guided steps (refreshes at steps 0, 3, … 24: 9 of 25), 2
  rounds: ~30 minutes on a 2-core CPU (`--sd15-steps 10` for a third of it).

Per round, in alternating order: one lone request each way (its latency), then 8 clients sending
a request each at once, all off or all cached (images/s over the round's wall time). Targets
(`meets_target`, ratios of the medians over rounds): 8 clients cached/off images/s ≥ 1.6 on the
SD-1.5 architecture and ≥ 1.25 on the built-in model. The counted share of the UNet's FLOPs in
the blocks a reusing row still runs (the shallow part) is printed beside them: the ratio's bound
is N / (refreshes + reuses × share).

What a CPU run cannot show: a ModelShard stage holding only deep blocks on its own GPU, idle
through reuse steps (tests/test_step_cache.py shows it is never entered).

    python -m benchmarks.speed.step_cache [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch
from diffusers import UNet2DConditionModel

from benchmarks.parallel.lone_split import build_folder
from benchmarks.serving.clients import at_once, lone
from server.demo import MODEL_DIR
from server.engine.planning.work import count_work
from tests.support.live import LiveServer, live_server

CLIENTS = 8
POLICY = {"policy": "deep", "interval": 3}
TARGETS = {"built_in": 1.25, "sd15_latent32": 1.6}
SHALLOW = ("embed", "conv_in", "down_blocks.0", "out")  # and the last up block


def shallow_share(folder: Path, latent: int) -> float:
    """The counted share of a forward's FLOPs a reusing row still runs."""
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
    work = count_work(unet, 2, latent, torch.float32)
    shallow = (*SHALLOW, f"up_blocks.{len(unet.up_blocks) - 1}")
    return sum(b.flops() for name, b in work.blocks.items() if name in shallow) / work.flops


def generate(server: LiveServer, body: dict[str, Any]) -> float:
    """One request's seconds; 8 SD-1.5 clients at once take minutes, past a client's usual wait."""
    return lone(server, body, timeout=1200)


def together(server: LiveServer, bodies: list[dict[str, Any]]) -> float:
    """Wall seconds for `bodies` sent together."""
    return at_once(len(bodies), lambda c: generate(server, bodies[c]))[1]


def measure(name: str, server: LiveServer, steps: int, rounds: int) -> dict[str, Any]:
    base = {"prompt": "a red circle", "num_inference_steps": steps, "guidance_scale": 5.0}
    ways = {"off": {"step_cache": "off"}, "cached": {"step_cache": POLICY}}
    lone: dict[str, list[float]] = {w: [] for w in ways}
    rate: dict[str, list[float]] = {w: [] for w in ways}
    generate(server, {**base, "num_inference_steps": 2, "step_cache": POLICY})  # warm-up
    for round_ in range(rounds):
        for way in list(ways)[round_ % 2 :] + list(ways)[: round_ % 2]:
            lone[way].append(generate(server, {**base, **ways[way], "seed": round_}))
            bodies = [{**base, **ways[way], "seed": 100 * round_ + c} for c in range(CLIENTS)]
            rate[way].append(CLIENTS / together(server, bodies))
            row = {"model": name, "round": round_, "way": way, "steps": steps}
            print(
                json.dumps(
                    {**row, "lone_s": round(lone[way][-1], 3), "images_per_s": round(rate[way][-1], 4)}
                )
            )
    engine = httpx.get(f"{server.url}/v1/stats", timeout=10).json()["engine"]
    median = {
        k: {w: statistics.median(v[w]) for w in ways} for k, v in (("lone_s", lone), ("images_per_s", rate))
    }
    return {
        "lone_s": {w: round(v, 3) for w, v in median["lone_s"].items()},
        "images_per_s": {w: round(v, 4) for w, v in median["images_per_s"].items()},
        "lone_speedup": round(median["lone_s"]["off"] / median["lone_s"]["cached"], 3),
        "clients_speedup": round(median["images_per_s"]["cached"] / median["images_per_s"]["off"], 3),
        "step_cache_rows": engine["step_cache_rows"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round, 4 steps on the SD-1.5 architecture")
    parser.add_argument(
        "--sd15-steps", type=int, default=25, help="steps of the SD-1.5-architecture requests"
    )
    parser.add_argument("--models", default=",".join(TARGETS), help="which of built_in,sd15_latent32 to run")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "built_in": (MODEL_DIR, 8, 25, 1 if args.quick else 5),
            "sd15_latent32": (
                build_folder(Path(tmp) / "sd15"),
                32,
                4 if args.quick else args.sd15_steps,
                1 if args.quick else 2,
            ),
        }
        chosen = args.models.split(",")
        for name, (folder, latent, steps, rounds) in models.items():
            if name not in chosen:
                continue
            # 8 clients of 25 SD-1.5 steps take ~7 minutes here: past the default request deadline
            with live_server("--model", str(folder), "--request-timeout-s", "3600") as server:
                results[name] = {**measure(name, server, steps, rounds), "steps": steps, "rounds": rounds}
            refreshes = len(range(0, steps, POLICY["interval"]))
            share = shallow_share(Path(folder), latent)
            bound = steps / (refreshes + (steps - refreshes) * share)
            results[name].update(shallow_flop_share=round(share, 3), counted_bound=round(bound, 3))
            print(json.dumps({"model": name, **results[name]}))
    meets = all(
        results[name]["clients_speedup"] >= target for name, target in TARGETS.items() if name in results
    )
    print(
        json.dumps(
            {
                "summary": True,
                "policy": POLICY,
                "clients": CLIENTS,
                **results,
                "targets": TARGETS,
                "meets_target": meets,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
