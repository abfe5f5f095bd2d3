"""Edits on the built-in model, judged (issue 24): served as the server serves them
(`Pipeline.load`, requests with an `Edit`, the model's recommended steps, guidance and scheduler).

- img2img: a dataset image of "a red circle" edited with the prompt "a blue circle" at strength
  0.8, seeds 0..N-1: each result judged by `server/demo/evaluate.py` (target: ≥ 80% blue circles);
  the other five colors for the record.
- inpainting: an image with a shape in each half (a red circle left, a blue square right), its
  left half repainted with "a green triangle" at strength 1.0: the mean absolute difference of
  the kept (right) half to the input, in 0..255 per channel, against that of the repainted half;
  served as the server serves it (the unmasked pixels kept: 0 by construction) and with
  keep_unmasked off (the model's whole image: the kept half as its VAE decodes it).

    python -m benchmarks.quality.edits [--seeds 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from server.demo import MODEL_DIR
from server.demo.dataset import COLORS, caption, sample_batch, to_uint8
from server.demo.evaluate import classify
from server.pipeline import Pipeline
from server.requests import Edit, GenerationRequest

STRENGTH = 0.8
TARGET = 0.8


def dataset_image(color: str, shape: str) -> Image.Image:
    """The first dataset image of a `color` `shape` under seed 0."""
    batch = sample_batch(256, torch.Generator().manual_seed(0), shapes=(shape,))
    i = batch.colors.index(color)
    return Image.fromarray(to_uint8(batch.images[i : i + 1])[0].numpy())


def two_shapes(size: int = 64) -> Image.Image:
    """A red circle in the left half, a blue square in the right, on the dataset's dark ground."""
    image = Image.new("RGB", (size, size), (14, 14, 14))
    draw = ImageDraw.Draw(image)
    draw.ellipse((4, 18, 28, 42), fill=tuple(COLORS["red"]))
    draw.rectangle((38, 20, 58, 40), fill=tuple(COLORS["blue"]))
    return image


def left_half(size: int = 64) -> Image.Image:
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle((0, 0, size // 2 - 1, size - 1), fill=255)
    return mask


def uint8(image: np.ndarray) -> np.ndarray:
    return (image * 255).round().astype(np.uint8)


def img2img(pipeline: Pipeline, seeds: int, color: str = "blue") -> dict[str, Any]:
    source = Edit(dataset_image("red", "circle"), None, STRENGTH)
    requests = [GenerationRequest(caption(color, "circle"), seed=k, edit=source) for k in range(seeds)]
    verdicts = [classify(uint8(image)) for image in pipeline.generate(requests)]
    right = [v.color == color and v.shape == "circle" for v in verdicts]
    return {
        "prompt": caption(color, "circle"),
        "judged_right": round(sum(right) / seeds, 4),
        "seen": dict(Counter(f"{v.color} {v.shape}" for v in verdicts).most_common()),
    }


def inpainting(pipeline: Pipeline, seeds: int, keep_unmasked: bool = True) -> dict[str, Any]:
    source, mask = two_shapes(), left_half()
    edit = Edit(source, mask, 1.0, keep_unmasked)
    requests = [GenerationRequest("a green triangle", seed=k, edit=edit) for k in range(seeds)]
    given = np.asarray(source).astype(float)
    kept, repainted, kept_max = [], [], []
    for image in pipeline.generate(requests):
        diff = np.abs(uint8(image).astype(float) - given)
        kept.append(float(diff[:, 32:].mean()))
        kept_max.append(float(diff[:, 32:].max()))
        repainted.append(float(diff[:, :32].mean()))
    return {
        "keep_unmasked": keep_unmasked,
        "kept_half_mean_abs_diff": round(statistics.median(kept), 2),
        "kept_half_worst": round(max(kept), 2),
        "kept_half_max_abs_diff": max(kept_max),
        "repainted_half_mean_abs_diff": round(statistics.median(repainted), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="4 seeds")
    args = parser.parse_args(argv)
    seeds = 4 if args.quick else args.seeds
    pipeline = Pipeline.load(MODEL_DIR, devices="cpu")
    asked = img2img(pipeline, seeds)
    print(json.dumps({"img2img": asked, "strength": STRENGTH, "seeds": seeds}))
    for color in (c for c in COLORS if c not in ("blue", "red")):
        print(json.dumps({"img2img": img2img(pipeline, seeds, color), "strength": STRENGTH, "seeds": seeds}))
    kept = inpainting(pipeline, seeds)
    print(json.dumps({"inpainting": kept, "seeds": seeds}))
    print(json.dumps({"inpainting": inpainting(pipeline, seeds, keep_unmasked=False), "seeds": seeds}))
    summary = {
        "summary": True,
        "blue_circle_judged_right": asked["judged_right"],
        "kept_half_mean_abs_diff": kept["kept_half_mean_abs_diff"],
        "repainted_half_mean_abs_diff": kept["repainted_half_mean_abs_diff"],
        "meets_target": asked["judged_right"] >= TARGET,
    }
    print(json.dumps(summary))
    return 0 if summary["meets_target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
