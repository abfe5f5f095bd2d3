"""Time to sample one image from the built-in model with diffusers' StableDiffusionPipeline.

At the folder's recommended settings (steps, guidance, DDIM), batch of one prompt (two UNet
rows with classifier-free guidance), on this machine's CPU. One JSON object per run, then a
summary with the median.

    python -m benchmarks.peers.diffusers_sampling [--quick] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from server.demo import MODEL_DIR
from server.demo.sampling import generate, load_pipeline, recommended
from server.engine.hardware.memory import retain_freed_host_memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 runs instead of 15")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    args = parser.parse_args(argv)
    retain_freed_host_memory()
    settings = recommended(args.model)
    steps, guidance = settings["num_inference_steps"], settings["guidance_scale"]
    pipe = load_pipeline(args.model)
    generate(pipe, ["a red circle"], [0], steps, guidance)  # warm-up

    times = []
    for run in range(3 if args.quick else 15):
        start = time.perf_counter()
        generate(pipe, ["a blue triangle"], [run], steps, guidance)
        times.append(time.perf_counter() - start)
        print(json.dumps({"run": run, "seconds": round(times[-1], 4)}), flush=True)
    median = statistics.median(times)
    summary = {
        "summary": True,
        "median_s": round(median, 4),
        "min_s": round(min(times), 4),
        "runs": len(times),
        "target_s": 1.0,
        "meets_target": median < 1.0,
        "steps": steps,
        "guidance_scale": guidance,
        "scheduler": type(pipe.scheduler).__name__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
