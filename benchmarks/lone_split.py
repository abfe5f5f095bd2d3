"""A lone request on every replica (issue 21): where splitting a request's rows pays, over HTTP.

The built-in model is dispatch-bound: two CPU workers each running one row of a lone request
contend for the interpreter and finish later than one worker running both rows, so the planner
does not split there (`benchmarks.thread_default` quotes its lone latency on replicas). This
benchmark serves a model where it pays: a folder with an SD-1.5-architecture UNet (random
weights, seed 0, latent 32²), a one-layer CLIP text encoder of SD's width and a tiny VAE
(64-pixel images), built here from config and saved as diffusers saves a pipeline.

Two real servers of that folder run side by side:

- `single_default`: `--devices cpu` (the planner's thread count for one worker);
- `replicas`: `--devices cpu,cpu --parallel replicas` (its plan must split lone requests).

In each round, one lone guided request (the same seed) goes to each, in alternating order; its
latency is timed end to end. Afterwards: the images must agree within 2/255, and `/v1/shards`
of `replicas` must show both workers busy. Target (`meets_target`): those two, and the median
lone latency on `replicas` at most 1.1× the single-device default's (CPU workers share this
host's cores: not slower; on two GPUs `tests/test_gpu.py` asks for ≤ 0.65×).

What a CPU run cannot show: two devices with their own compute (the workers here share the
cores and memory bandwidth), transfers between devices.

    python -m benchmarks.lone_split [--quick]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from PIL import Image
from transformers import CLIPTextModel

from server.demo.tokenizer import build_tokenizer
from server.pipeline.families.sd import SD
from tests.live import LiveServer, live_server
from tests.tiny_pipelines import SD_SCHEDULE, _text_config, _vae

LATENT = 32
TARGET_LONE = 1.1
MAX_PIXEL_DIFF = 2
SERVERS = {
    "single_default": ("--devices", "cpu"),
    "replicas": ("--devices", "cpu,cpu", "--parallel", "replicas"),
}


def build_folder(folder: Path) -> Path:
    """SD-1.5's UNet at latent 32² with a text encoder of its width (one layer) and a tiny VAE."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    unet_config = {**SD.reference_configs["sd15"], "sample_size": LATENT}
    text = _text_config(tokenizer)  # tiny, then SD's width with one layer
    text.update(
        {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 1, "num_attention_heads": 12}
    )
    StableDiffusionPipeline(
        vae=_vae(),
        text_encoder=CLIPTextModel(text),
        tokenizer=tokenizer,
        unet=UNet2DConditionModel(**unet_config),
        scheduler=DDIMScheduler(**SD_SCHEDULE),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(folder, safe_serialization=True)
    return folder


def lone_request(server: LiveServer, steps: int) -> tuple[float, np.ndarray]:
    body = {"prompt": "a red circle", "seed": 7, "num_inference_steps": steps, "guidance_scale": 5.0}
    started = time.perf_counter()
    answer = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=600)
    seconds = time.perf_counter() - started
    answer.raise_for_status()
    png = base64.b64decode(answer.json()["data"][0]["b64_json"])
    return seconds, np.asarray(Image.open(io.BytesIO(png))).astype(int)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds of 2 steps instead of 5 of 4")
    args = parser.parse_args(argv)
    rounds, steps = (3, 2) if args.quick else (5, 4)
    seconds: dict[str, list[float]] = {name: [] for name in SERVERS}
    images: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = build_folder(Path(tmp) / "sd15-latent32")
        running = {
            name: stack.enter_context(live_server("--model", str(folder), *flags))
            for name, flags in SERVERS.items()
        }
        plans = {name: httpx.get(f"{s.url}/v1/shards").json()["parallel"] for name, s in running.items()}
        print(
            json.dumps(
                {
                    "plans": {
                        n: {k: p[k] for k in ("replicas", "threads_per_lane", "splits_lone_requests")}
                        for n, p in plans.items()
                    }
                }
            )
        )
        for server in running.values():  # warm-up
            lone_request(server, 1)
        for round_ in range(rounds):
            for name in list(running)[round_ % 2 :] + list(running)[: round_ % 2]:
                taken, images[name] = lone_request(running[name], steps)
                seconds[name].append(taken)
                print(
                    json.dumps(
                        {"round": round_, "server": name, "steps": steps, "latency_s": round(taken, 3)}
                    )
                )
        busy = httpx.get(f"{running['replicas'].url}/v1/shards").json()["parallel"]["busy_seconds"]

    median = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = median["replicas"] / median["single_default"]
    diff = int(np.abs(images["replicas"] - images["single_default"]).max())
    checks: dict[str, Any] = {
        "replicas split lone requests": bool(plans["replicas"]["splits_lone_requests"]),
        "both workers busy": len(busy) == 2 and min(busy.values()) > 0,
        f"images within {MAX_PIXEL_DIFF}/255": diff <= MAX_PIXEL_DIFF,
        f"lone latency ≤ {TARGET_LONE}× the single-device default": ratio <= TARGET_LONE,
    }
    print(
        json.dumps(
            {
                "summary": True,
                "rounds": rounds,
                "steps": steps,
                "median_latency_s": {n: round(s, 3) for n, s in median.items()},
                "replicas_over_single": round(ratio, 3),
                "max_pixel_diff": diff,
                "busy_seconds": {w: round(s, 2) for w, s in busy.items()},
                "checks": checks,
                "meets_target": all(checks.values()),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
