"""A lone request on every replica (issue 21): where splitting a request's rows pays, over HTTP.

The built-in model is dispatch-bound: two CPU workers each running one row of a lone request
contend for the interpreter and finish later than one worker running both rows, so the planner
does not split there (`benchmarks.parallel.thread_default` quotes its lone latency on replicas). This
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

LoRA (on unless `--no-lora`): both servers also serve `style`, a random rank-4 adapter (seed 1,
the diffusers/PEFT format, `tests/test_lora.py::random_pairs`) on every attention projection of
the UNet, and each round also sends the lone request with `"lora": {"style": 0.8}` to each,
alternating. Every denoiser call goes through one block walker with its call plan, so a
request with an adapter splits over idle replicas like any other (before, such rows never
split). Shown: the median LoRA latency per server; `replicas`' LoRA images equal the single
server's within 2/255; `/v1/shards` busy seconds read before and after each LoRA request on
`replicas`, summed: both workers busy in those requests, within 25% of each other (min/max ≥
0.75: the adapter's rows are shared out, not run on one worker); and the LoRA image differs from
the plain one by more than 10/255, so the adapter did apply. All three enter `meets_target`.
The summary's `busy_seconds` stays the whole run's (warm-up and LoRA requests included).

What a CPU run cannot show: two devices with their own compute (the workers here share the
cores and memory bandwidth), transfers between devices; for the LoRA requests, no latency
target (printed only: whether the split pays with an adapter on devices of their own is for a
GPU run), nor what the adapter's weights cost in device memory on each replica.

    python -m benchmarks.parallel.lone_split [--quick] [--no-lora]
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
from diffusers import UNet2DConditionModel
from PIL import Image
from safetensors.torch import save_file
from transformers import CLIPTextModel

from server.demo.tokenizer import build_tokenizer
from server.pipeline.families.sd import SD
from tests.support.live import LiveServer, live_server
from tests.support.lora import RANK, UNET_TARGETS, random_pairs
from tests.support.tiny_pipelines import _text_config, _vae, save_sd_folder

LATENT = 32
TARGET_LONE = 1.1
MAX_PIXEL_DIFF = 2
LORA_SCALE = 0.8
MIN_LORA_EFFECT = 10  # the LoRA image differs from the plain one by more (max abs, /255)
MIN_BUSY_BALANCE = 0.75  # the two workers' busy seconds in the LoRA requests: min/max
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
    return save_sd_folder(folder, _vae(), CLIPTextModel(text), tokenizer, UNet2DConditionModel(**unet_config))


def build_lora(folder: Path, out: Path, seed: int = 1) -> Path:
    """A random rank-4 LoRA on the folder's UNet attention projections (to_q, to_k, to_v,
    to_out.0), keys `unet.<module>.lora_A.weight` / `lora_B.weight`: `random_pairs`' draws,
    large enough to change the image visibly. The UNet is built on the meta device: only its
    layers' names and shapes are read."""
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
    tensors: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(seed)
    list(random_pairs((("unet", unet, UNET_TARGETS),), generator, RANK, tensors))
    save_file(tensors, out)
    return out


def busy_seconds(server: LiveServer) -> dict[str, float]:
    """Each worker's busy seconds so far (cumulative), from /v1/shards."""
    return httpx.get(f"{server.url}/v1/shards", timeout=30).json()["parallel"]["busy_seconds"]


def lone_request(
    server: LiveServer, steps: int, lora: dict[str, float] | None = None
) -> tuple[float, np.ndarray]:
    body: dict[str, Any] = {
        "prompt": "a red circle",
        "seed": 7,
        "num_inference_steps": steps,
        "guidance_scale": 5.0,
    }
    if lora:
        body["lora"] = lora
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
    parser.add_argument("--no-lora", dest="lora", action="store_false", help="skip the LoRA requests")
    args = parser.parse_args(argv)
    rounds, steps = (3, 2) if args.quick else (5, 4)
    scales = {"style": LORA_SCALE}
    seconds: dict[str, list[float]] = {name: [] for name in SERVERS}
    lora_seconds: dict[str, list[float]] = {name: [] for name in SERVERS}
    images: dict[str, np.ndarray] = {}
    lora_images: dict[str, np.ndarray] = {}
    lora_busy: dict[str, float] = {}  # replicas' workers: busy seconds in the LoRA requests only
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = build_folder(Path(tmp) / "sd15-latent32")
        adapter: tuple[str, ...] = ()
        if args.lora:
            adapter = ("--lora", f"style={build_lora(folder, Path(tmp) / 'style.safetensors')}")
        running = {
            name: stack.enter_context(live_server("--model", str(folder), *adapter, *flags))
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
            if args.lora:
                lone_request(server, 1, scales)
        for round_ in range(rounds):
            order = list(running)[round_ % 2 :] + list(running)[: round_ % 2]
            for name in order:
                taken, images[name] = lone_request(running[name], steps)
                seconds[name].append(taken)
                print(
                    json.dumps(
                        {"round": round_, "server": name, "steps": steps, "latency_s": round(taken, 3)}
                    )
                )
            for name in order if args.lora else ():  # the same request with the adapter
                before = busy_seconds(running[name]) if name == "replicas" else {}
                taken, lora_images[name] = lone_request(running[name], steps, scales)
                lora_seconds[name].append(taken)
                line = {"round": round_, "server": name, "steps": steps, "lora": scales}
                line["latency_s"] = round(taken, 3)
                if name == "replicas":
                    after = busy_seconds(running[name])
                    delta = {w: after[w] - before.get(w, 0.0) for w in after}
                    for worker, busy_s in delta.items():
                        lora_busy[worker] = lora_busy.get(worker, 0.0) + busy_s
                    line["busy_s"] = {w: round(b, 3) for w, b in delta.items()}
                print(json.dumps(line))
        busy = busy_seconds(running["replicas"])

    median = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = median["replicas"] / median["single_default"]
    diff = int(np.abs(images["replicas"] - images["single_default"]).max())
    checks: dict[str, Any] = {
        "replicas split lone requests": bool(plans["replicas"]["splits_lone_requests"]),
        "both workers busy": len(busy) == 2 and min(busy.values()) > 0,
        f"images within {MAX_PIXEL_DIFF}/255": diff <= MAX_PIXEL_DIFF,
        f"lone latency ≤ {TARGET_LONE}× the single-device default": ratio <= TARGET_LONE,
    }
    summary: dict[str, Any] = {
        "summary": True,
        "rounds": rounds,
        "steps": steps,
        "median_latency_s": {n: round(s, 3) for n, s in median.items()},
        "replicas_over_single": round(ratio, 3),
        "max_pixel_diff": diff,
        "busy_seconds": {w: round(s, 2) for w, s in busy.items()},
    }
    if args.lora:
        lora_median = {name: statistics.median(values) for name, values in lora_seconds.items()}
        lora_diff = int(np.abs(lora_images["replicas"] - lora_images["single_default"]).max())
        lora_effect = int(np.abs(lora_images["single_default"] - images["single_default"]).max())
        balance = min(lora_busy.values()) / max(lora_busy.values()) if lora_busy else 0.0
        summary["lora"] = {
            "scales": scales,
            "median_latency_s": {n: round(s, 3) for n, s in lora_median.items()},
            "replicas_over_single": round(lora_median["replicas"] / lora_median["single_default"], 3),
            "max_pixel_diff": lora_diff,
            "max_diff_to_plain": lora_effect,
            "busy_seconds": {w: round(s, 2) for w, s in lora_busy.items()},
            "busy_balance": round(balance, 3),
        }
        checks.update(
            {
                f"LoRA images within {MAX_PIXEL_DIFF}/255": lora_diff <= MAX_PIXEL_DIFF,
                f"both workers busy in LoRA requests, min/max ≥ {MIN_BUSY_BALANCE}": (
                    len(lora_busy) == 2 and min(lora_busy.values()) > 0 and balance >= MIN_BUSY_BALANCE
                ),
                f"LoRA image differs from the plain one by > {MIN_LORA_EFFECT}/255": (
                    lora_effect > MIN_LORA_EFFECT
                ),
            }
        )
    summary["checks"] = checks
    summary["meets_target"] = all(checks.values())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
