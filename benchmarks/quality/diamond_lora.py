"""The diamond adapter (`server/demo/adapters/diamond.safetensors`, trained by
`python -m server.demo.train_lora`) judged as the server serves it: `Pipeline.load`, the file read
by `read_adapter` and added, requests through `generate` at the model's recommended steps and
guidance, each image judged by `server.demo.evaluate.classify`.

Four sets of "a {color} {shape}" prompts × `--seeds` seeds (0..N-1), all on one pipeline with the
adapter loaded:

- diamond prompts with the adapter at scale 1.0: target ≥ 80% judged a diamond of the right color;
- the same prompts without it: target, none judged a diamond (the base model never saw one);
- the 18 base prompts without it: target ≥ 90% color and ≥ 80% shape (the model's own bar);
- the 18 base prompts with it: for the record (the adapter is only applied when asked for).

The figures, and which targets are met, go into the adapter's JSON (`evaluation`) and are printed.

    python -m benchmarks.quality.diamond_lora [--seeds 4] [--adapter PATH]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from server.demo import MODEL_DIR
from server.demo.dataset import COLORS, SHAPES, caption
from server.demo.evaluate import classify
from server.demo.sampling import recommended
from server.demo.train_lora import DEFAULT_OUT, SHAPE
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.requests import GenerationRequest

Choice = tuple[tuple[str, float], ...]
CHUNK = 24  # requests per generate call: 48 UNet rows with guidance


def judge(pipeline: Pipeline, pairs: list[tuple[str, str]], seeds: int, lora: Choice) -> dict[str, Any]:
    """Color, shape and both accuracy over `pairs` (color, shape) × seeds; what shapes were seen."""
    cases = [(color, shape, seed) for color, shape in pairs for seed in range(seeds)]
    requests = [GenerationRequest(caption(c, s), seed=k, lora=lora) for c, s, k in cases]
    images = [
        image for i in range(0, len(requests), CHUNK) for image in pipeline.generate(requests[i : i + CHUNK])
    ]
    verdicts = [classify((image * 255).round().astype(np.uint8)) for image in images]  # [0, 1] → uint8
    color_ok = [v.color == c for v, (c, _, _) in zip(verdicts, cases, strict=True)]
    shape_ok = [v.shape == s for v, (_, s, _) in zip(verdicts, cases, strict=True)]
    both_ok = [a and b for a, b in zip(color_ok, shape_ok, strict=True)]
    n = len(cases)
    return {
        "n": n,
        "color": round(sum(color_ok) / n, 4),
        "shape": round(sum(shape_ok) / n, 4),
        "both": round(sum(both_ok) / n, 4),
        "seen_shapes": dict(Counter(str(v.shape) for v in verdicts).most_common()),
        "seen_colors": dict(Counter(str(v.color) for v in verdicts).most_common()),
        "missed": [
            f"{c} {s} seed {k}: seen {v.color} {v.shape}"
            for (c, s, k), v, ok in zip(cases, verdicts, both_ok, strict=True)
            if not ok and (lora or s != SHAPE)  # unasked diamonds all "miss": seen_shapes says how
        ],
    }


def evaluate(adapter: Path, seeds: int, folder: Path = MODEL_DIR) -> dict[str, Any]:
    pipeline = Pipeline.load(folder, devices="cpu")
    pipeline.add_adapter(read_adapter(SHAPE, adapter, pipeline.family))
    asked: Choice = ((SHAPE, 1.0),)
    new = [(c, SHAPE) for c in COLORS]
    base = [(c, s) for c in COLORS for s in SHAPES]
    settings = recommended(folder)
    started = time.perf_counter()
    figures = {
        "served_with": {
            "steps": settings["num_inference_steps"],
            "guidance_scale": settings["guidance_scale"],
            "scheduler": settings["scheduler"],
            "seeds": list(range(seeds)),
            "scale": 1.0,
        },
        "diamond_prompts_with_adapter": judge(pipeline, new, seeds, asked),
        "diamond_prompts_without_adapter": judge(pipeline, new, seeds, ()),
        "base_prompts_adapter_loaded_not_asked": judge(pipeline, base, seeds, ()),
        "base_prompts_with_adapter": judge(pipeline, base, seeds, asked),
    }
    figures["seconds"] = round(time.perf_counter() - started, 1)
    base_figures = figures["base_prompts_adapter_loaded_not_asked"]
    figures["targets_met"] = {
        "diamonds_with_adapter_at_least_80%": figures["diamond_prompts_with_adapter"]["both"] >= 0.8,
        "no_diamonds_without_adapter": figures["diamond_prompts_without_adapter"]["seen_shapes"].get(SHAPE, 0)
        == 0,
        "base_prompts_90%_color_80%_shape": base_figures["color"] >= 0.9 and base_figures["shape"] >= 0.8,
    }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--adapter", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0..N-1 for every prompt")
    args = parser.parse_args(argv)
    if args.seeds <= 0:
        parser.error(f"--seeds must be positive, got {args.seeds}")
    figures = evaluate(args.adapter, args.seeds)
    command = ["python", "-m", "benchmarks.quality.diamond_lora", *(sys.argv[1:] if argv is None else argv)]
    figures["command"] = shlex.join(command)
    for name, value in figures.items():
        print(json.dumps({"evaluation": name, "figures": value}))
    summary = args.adapter.with_suffix(".json")
    if summary.is_file():  # the training figures: add these beside them
        summary.write_text(
            json.dumps(json.loads(summary.read_text()) | {"evaluation": figures}, indent=2) + "\n"
        )
    return 0 if all(figures["targets_met"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
