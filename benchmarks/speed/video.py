"""Video requests batched step by step (issue 41): 4 concurrent Wan requests in one step loop
against the same 4 one at a time, and both with step caching (`first_block`), in frames/s;
(issue 51) Wan 2.2 A14B's two experts: the same 4 videos on a two-expert folder one at a time,
all at once, and `staggered` (each joining 3 steps after the one before, so a step holds rows
of both experts: a call per expert, the rows of each batched); and (issue 71) HunyuanVideo-1.5:
the same 4 one at a time and all at once, on a HunyuanVideo-1.5-shaped folder (its transformer
of 4 double-stream blocks, 8 heads of 64; the tests' tiny encoders and 16× VAE: 8×8 latents of
the 128×128 frames, 320 video tokens beside each prompt's text and glyph tokens); and LTX-2:
4 videos with their sound one at a time and all at once, each at the pipeline's default guidance
(4 rows a step: negative, prompt, perturbed, isolated), on an LTX-2-shaped folder (4 blocks, the
video's 8 heads of 64, the audio's 4 of 32; the tests' tiny Gemma 3, connectors and VAEs: 9
frames of 32×32, 5 latent frames of 16×16: 1280 video tokens and 9 audio tokens a row).

The model is a Wan-2.1-shaped folder built here from config, random weights (seed 0): a video
transformer of 4 blocks, 8 heads of 64 (inner 512, FFN 2048), and the tiny VAE and UMT5 encoder
of the tests (`tests/support/tiny_pipelines.build_wan_folder`), so the transformer's work dominates; the
two-expert folder holds two such transformers (`tests/support/tiny_wan22`, boundary 0.875, shift 3: the
first 4 of 12 steps on the high-noise expert).
Each request: 17 frames of 128×128 (5 latent frames of 16×16: 320 tokens), guided (2 rows), 12
steps, its own seed. Through `Service` (the step loop the HTTP routes use, no HTTP): `batched`
submits all 4 at once (one call of 8 rows a step), `sequential` waits for each before the next.
Rounds alternate the modes; medians of the rounds' frames/s, and ratios as the median of each
round's ratio (paired).

No target is named by the issues: `meets_target` checks only that batching and step caching do
not slow videos down, nor do two experts' rows batched or staggered (each ≥ 1.0× what it
replaces, from the printed medians). What a CPU run
cannot show: a GPU's batching gain (a CPU's rows-per-call gain is small once a call fills its
cores), real Wan weights' step-cache reuse rate (random weights change more per step).

    python -m benchmarks.speed.video [--quick] [--rounds N]
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
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.requests.step_cache import StepCache
from server.serving import Service
from tests.support.tiny_hunyuan15 import build_hunyuan15_folder
from tests.support.tiny_ltx2 import build_ltx2_folder
from tests.support.tiny_pipelines import build_wan_folder
from tests.support.tiny_wan22 import build_wan22_two_expert_folder

SIZE, FRAMES, STEPS, VIDEOS = 128, 17, 12, 4
LEAD = 3  # staggered: steps a video takes before the next joins
SHAPE = {"num_attention_heads": 8, "attention_head_dim": 64, "ffn_dim": 2048, "num_layers": 4}
MODELS = {"two_experts": "wan2.2-a14b", "hunyuan15": "hunyuanvideo-1.5", "ltx2": "ltx-2"}  # others: wan2.1
# the same width; its rotary axes (frames, height, width) sum to the head's 64
HUNYUAN_SHAPE = {
    "num_attention_heads": 8,
    "attention_head_dim": 64,
    "num_layers": 4,
    "rope_axes_dim": (16, 24, 24),
}
LTX_SHAPE = {
    "num_attention_heads": 8,
    "attention_head_dim": 64,
    "cross_attention_dim": 512,
    "audio_num_attention_heads": 4,
    "audio_attention_head_dim": 32,
    "audio_cross_attention_dim": 128,
    "num_layers": 4,
}
LTX_VIDEO = {"width": 32, "height": 32, "frames": 9}  # the tiny VAE's 2× in space and time
CACHE = StepCache("first_block", threshold=0.2)


def requests(cache: StepCache | None, model: str = "wan2.1") -> list[GenerationRequest]:
    if model == "ltx2":  # the pipeline's default guidance: its four passes
        return [
            GenerationRequest(f"a red circle {i}", seed=i, steps=STEPS, **LTX_VIDEO) for i in range(VIDEOS)
        ]
    return [
        GenerationRequest(
            f"a red circle {i}",
            seed=i,
            steps=STEPS,
            guidance_scale=5.0,
            width=SIZE,
            height=SIZE,
            frames=FRAMES,
            step_cache=cache,
        )
        for i in range(VIDEOS)
    ]


def frames_per_s(service: Service, mode: str, cache: StepCache | None, model: str = "wan2.1") -> float:
    started = time.perf_counter()
    asked = requests(cache, model)
    if mode == "sequential":
        for request in asked:
            service.submit([request]).future.result(timeout=600)
    else:
        jobs = []
        for request in asked:
            if jobs and mode == "staggered":
                took_steps(service, jobs[-1], LEAD)
            jobs.append(service.submit([request]))
        for job in jobs:
            job.future.result(timeout=600)
    return sum(r.frames for r in asked) / (time.perf_counter() - started)


def took_steps(service: Service, job: object, steps: int, timeout_s: float = 600.0) -> None:
    """Wait (polling with a short backoff, to a deadline) until `job` took `steps` or ended."""
    deadline, pause = time.monotonic() + timeout_s, 0.001
    while not job.future.done():  # type: ignore[attr-defined]
        progress = service.stats().progress.get(job.id)  # type: ignore[attr-defined]
        if progress and progress[0][0] >= steps:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the video took fewer than {steps} steps in {timeout_s} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def rounds_of(service: Service, configs: dict, rounds: int, model: str = "wan2.1") -> dict:
    """Each config's frames/s per round, the configs alternating within a round."""
    frames_per_s(service, "batched", None, model)  # warm-up
    rates: dict = {key: [] for key in configs}
    for _ in range(rounds):
        for key, (mode, cache) in configs.items():
            rates[key].append(frames_per_s(service, mode, cache, model))
    return rates


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
                (mode, name): (mode, cache)
                for name, cache in (("plain", None), ("first_block", CACHE))
                for mode in ("sequential", "batched")
            }
            rates = rounds_of(service, configs, rounds)
            rows = dict(service.stats().batch_rows)
        finally:
            service.close()
        folder = build_wan22_two_expert_folder(Path(tmp) / "a14b", **SHAPE)
        pipeline = Pipeline.load(folder, devices="cpu")
        service = Service(pipeline, "wan22-shaped", max_batch=16)
        try:
            modes = ("sequential", "batched", "staggered")
            rates |= rounds_of(service, {(mode, "two_experts"): (mode, None) for mode in modes}, rounds)
            experts = pipeline.expert_steps.view()
        finally:
            service.close()
        folder = build_hunyuan15_folder(Path(tmp) / "hunyuan15", **HUNYUAN_SHAPE)
        service = Service(Pipeline.load(folder, devices="cpu"), "hunyuan15-shaped", max_batch=16)
        try:
            rates |= rounds_of(service, {(mode, "hunyuan15"): (mode, None) for mode in modes[:2]}, rounds)
        finally:
            service.close()
        folder = build_ltx2_folder(Path(tmp) / "ltx2", **LTX_SHAPE)
        service = Service(Pipeline.load(folder, devices="cpu"), "ltx2-shaped", max_batch=16)
        try:
            ltx = {(mode, "ltx2"): (mode, None) for mode in modes[:2]}
            rates |= rounds_of(service, ltx, rounds, "ltx2")
        finally:
            service.close()
    medians = {key: statistics.median(values) for key, values in rates.items()}
    for (mode, name), values in rates.items():
        print(
            json.dumps(
                {
                    "mode": mode,
                    "model": MODELS.get(name, "wan2.1"),
                    "step_cache": "plain" if name in MODELS else name,
                    "frames_per_s": round(medians[mode, name], 3),
                    "rounds": [round(v, 3) for v in values],
                }
            )
        )

    def paired(key: tuple[str, str], base: tuple[str, str]) -> float:
        """The median of the rounds' ratios (a round runs both, one after the other)."""
        return statistics.median(a / b for a, b in zip(rates[key], rates[base], strict=True))

    batching = paired(("batched", "plain"), ("sequential", "plain"))
    caching = paired(("batched", "first_block"), ("batched", "plain"))
    two = {mode: paired((mode, "two_experts"), ("sequential", "two_experts")) for mode in modes[1:]}
    hunyuan = paired(("batched", "hunyuan15"), ("sequential", "hunyuan15"))
    ltx = paired(("batched", "ltx2"), ("sequential", "ltx2"))
    print(
        json.dumps(
            {
                "summary": True,
                "videos": VIDEOS,
                "frames": FRAMES,
                "size": SIZE,
                "steps": STEPS,
                "transformer": SHAPE,
                "threads": torch.get_num_threads(),
                "batched_over_sequential": round(batching, 3),
                "first_block_over_plain_batched": round(caching, 3),
                "two_experts_batched_over_sequential": round(two["batched"], 3),
                "two_experts_staggered_over_sequential": round(two["staggered"], 3),
                "two_experts_steps": experts,
                "hunyuan15_transformer": HUNYUAN_SHAPE,
                "hunyuan15_batched_over_sequential": round(hunyuan, 3),
                "ltx2_transformer": LTX_SHAPE,
                "ltx2_video": LTX_VIDEO,
                "ltx2_batched_over_sequential": round(ltx, 3),
                "rows_per_call": {str(k): v for k, v in sorted(rows.items())},
                "target": "batching, step caching, two experts' rows batched or staggered, "
                "HunyuanVideo-1.5's and LTX-2's batching each >= 1.0x what they replace (no target is named)",
                "meets_target": min(batching, caching, *two.values(), hunyuan, ltx) >= 1.0,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
