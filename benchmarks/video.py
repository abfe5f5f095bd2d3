"""Video requests batched step by step (issue 41): 4 concurrent Wan requests in one step loop
against the same 4 one at a time, and both with step caching (`first_block`), in frames/s.

The model is a Wan-2.1-shaped folder built here from config, random weights (seed 0): a video
transformer of 4 blocks, 8 heads of 64 (inner 512, FFN 2048), and the tiny VAE and UMT5 encoder
of the tests (`tests/tiny_pipelines.build_wan_folder`), so the transformer's work dominates.
Each request: 17 frames of 128×128 (5 latent frames of 16×16: 320 tokens), guided (2 rows), 12
steps, its own seed. Through `Service` (the step loop the HTTP routes use, no HTTP): `batched`
submits all 4 at once (one call of 8 rows a step), `sequential` waits for each before the next.
Rounds alternate the modes; medians of the rounds' frames/s.

No target is named by the issue: `meets_target` checks only that batching and step caching do
not slow videos down (each ≥ 1.0× what it replaces, from the printed medians). What a CPU run
cannot show: a GPU's batching gain (a CPU's rows-per-call gain is small once a call fills its
cores), real Wan weights' step-cache reuse rate (random weights change more per step).

    python -m benchmarks.video [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from server.engine.hardware.memory import retain_freed_host_memory
from server.pipeline import GenerationRequest, Pipeline
from server.pipeline.stepcache import StepCache
from server.serving import Service
from tests.tiny_pipelines import build_wan_folder

SIZE, FRAMES, STEPS, VIDEOS = 128, 17, 12, 4
SHAPE = {"num_attention_heads": 8, "attention_head_dim": 64, "ffn_dim": 2048, "num_layers": 4}
CACHE = StepCache("first_block", threshold=0.2)


def requests(cache: StepCache | None) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"a red circle {i}", seed=i, steps=STEPS, guidance_scale=5.0, width=SIZE,
                          height=SIZE, frames=FRAMES, step_cache=cache)
        for i in range(VIDEOS)
    ]  # fmt: skip


def frames_per_s(service: Service, batched: bool, cache: StepCache | None) -> float:
    started = time.perf_counter()
    if batched:
        jobs = [service.submit([r]) for r in requests(cache)]
        for job in jobs:
            job.future.result(timeout=600)
    else:
        for request in requests(cache):
            service.submit([request]).future.result(timeout=600)
    return VIDEOS * FRAMES / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round instead of 3")
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    retain_freed_host_memory()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_wan_folder(Path(tmp) / "wan", **SHAPE)
        service = Service(Pipeline.load(folder, devices="cpu"), "wan-shaped", max_batch=16)
        try:
            configs = {
                (mode, name): (mode == "batched", cache)
                for name, cache in (("plain", None), ("first_block", CACHE))
                for mode in ("sequential", "batched")
            }
            frames_per_s(service, True, None)  # warm-up
            rates: dict[tuple[str, str], list[float]] = {key: [] for key in configs}
            for _ in range(rounds):
                for key, (batched, cache) in configs.items():
                    rates[key].append(frames_per_s(service, batched, cache))
            rows = dict(service.stats().batch_rows)
        finally:
            service.close()
    medians = {key: statistics.median(values) for key, values in rates.items()}
    for (mode, name), values in rates.items():
        print(json.dumps({"mode": mode, "step_cache": name, "frames_per_s": round(medians[mode, name], 3),
                          "rounds": [round(v, 3) for v in values]}))  # fmt: skip
    batching = medians["batched", "plain"] / medians["sequential", "plain"]
    caching = medians["batched", "first_block"] / medians["batched", "plain"]
    print(json.dumps({
        "summary": True, "videos": VIDEOS, "frames": FRAMES, "size": SIZE, "steps": STEPS,
        "transformer": SHAPE, "threads": torch.get_num_threads(),
        "batched_over_sequential": round(batching, 3), "first_block_over_plain_batched": round(caching, 3),
        "rows_per_call": {str(k): v for k, v in sorted(rows.items())},
        "target": "batching and step caching each >= 1.0x what they replace (no target is named)",
        "meets_target": batching >= 1.0 and caching >= 1.0,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
