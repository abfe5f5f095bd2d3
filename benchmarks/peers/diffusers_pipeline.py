"""Our pipeline against diffusers' StableDiffusionPipeline, and batched against sequential.

On the built-in model at its recommended settings (steps, guidance, DDIM), on this machine:

1. one image: our pipeline's wall time vs `StableDiffusionPipeline` on the same folder,
   steps and scheduler. The two alternate within each round; the ratio (ours / theirs) is
   taken per round, and its median and quartiles are reported (target: ratio ≤ 1.0);
2. eight requests stepped together (one batched UNet call per step) vs the same eight one
   after another: images per second of each, and their ratio within each round.

One JSON object per round, then a summary, on stdout.

    python -m benchmarks.peers.diffusers_pipeline [--quick] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from server.demo import MODEL_DIR
from server.demo.dataset import all_prompts
from server.demo.sampling import generate, load_pipeline
from server.engine.hardware.memory import retain_freed_host_memory
from server.pipeline.pipeline import GenerationRequest, Pipeline

TARGET_RATIO = 1.0
BATCH = 8


def timed(run: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 11")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    args = parser.parse_args(argv)
    retain_freed_host_memory()

    ours = Pipeline.load(args.model, devices="cpu")
    theirs = load_pipeline(args.model)
    defaults = ours.defaults
    steps, guidance = defaults.steps, defaults.guidance_scale
    prompts = [prompt for _, _, prompt in all_prompts()]
    requests = [GenerationRequest(prompts[i], seed=i) for i in range(BATCH)]

    def ours_one(seed: int) -> None:
        ours.generate([GenerationRequest(prompts[seed % len(prompts)], seed=seed)])

    def theirs_one(seed: int) -> None:
        generate(theirs, [prompts[seed % len(prompts)]], [seed], steps, guidance)

    def together() -> None:
        ours.generate(requests)

    def one_after_another() -> None:
        for request in requests:
            ours.generate([request])

    for warm_up in (lambda: ours_one(0), lambda: theirs_one(0), together):
        warm_up()

    rows = []
    for round_ in range(3 if args.quick else 11):
        # alternate who goes first, so neither always runs on a warmer cache
        first, second = (ours_one, theirs_one) if round_ % 2 == 0 else (theirs_one, ours_one)
        a, b = timed(first, round_), timed(second, round_)
        ours_s, theirs_s = (a, b) if first is ours_one else (b, a)
        together_s, sequential_s = timed(together), timed(one_after_another)
        row = {
            "round": round_,
            "ours_s": round(ours_s, 4),
            "diffusers_s": round(theirs_s, 4),
            "ratio": round(ours_s / theirs_s, 4),
            "together_images_per_s": round(BATCH / together_s, 3),
            "sequential_images_per_s": round(BATCH / sequential_s, 3),
            "batching_speedup": round(sequential_s / together_s, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 4)

    low, high = quartiles([r["ratio"] for r in rows])
    stats = ours.pool.stats()["cpu"]
    summary = {
        "summary": True,
        "rounds": len(rows),
        "ours_median_s": median("ours_s"),
        "diffusers_median_s": median("diffusers_s"),
        "ratio_median": median("ratio"),
        "ratio_iqr": [round(low, 4), round(high, 4)],
        "target_ratio": TARGET_RATIO,
        "meets_target": median("ratio") <= TARGET_RATIO,
        "batch": BATCH,
        "together_images_per_s": median("together_images_per_s"),
        "sequential_images_per_s": median("sequential_images_per_s"),
        "batching_speedup_median": median("batching_speedup"),
        "pool_hit_rate": round(stats.hit_rate, 4),
        "pool_bytes_pooled": stats.bytes_pooled,
        "steps": steps,
        "guidance_scale": guidance,
        "scheduler": type(theirs.scheduler).__name__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
