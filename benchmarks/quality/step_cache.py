"""Step caching's quality (issue 27): what reusing features costs the images, measured.

1. The built-in model at its recommended settings, the evaluator's 6 colors × 3 shapes × 4 seeds
   (`server/demo/evaluate.py`, as `python -m server.demo.sampling` scores it), uncached and with
   each `deep` interval in INTERVALS (3 is the default): color and shape accuracy, and the mean
   absolute pixel difference (0-255) to the uncached image of the same prompt and seed.
   Per image too: each policy's worst prompt × seed by mean absolute difference (its value), the
   distribution (median, 90th percentile) and the share of images more than OVER/255 off: the
   figure a README may quote is the worst case, not the mean (`--worst DIR` writes the default
   policy's worst pair there as PNGs, to look at).
   Target (`meets_target`): the default's accuracies within 3 points of uncached.
2. Tiny random SD-1.5-, SD3- and FLUX.1-dev-shaped folders (tests/support/tiny_pipelines.py), 8 seeds of
   20 steps (--quick: 2): the difference to uncached per `deep` interval (SD-1.5) and per
   `first_block` threshold (SD3: THRESHOLDS, FLUX.1: FLUX_THRESHOLDS, each spanning no reuse to
   most rows reused on its model), and the share of rows that reused: the table a user chooses a
   setting from. No target: random weights say how the settings compare, not what a trained
   model's images lose.

Requests run as the server runs them (`Pipeline.generate`, 8 at a time, stepped together).

    python -m benchmarks.quality.step_cache [--quick] [--seeds 4] [--grid docs/step-cache.png] [--worst DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from server.demo import MODEL_DIR
from server.demo.dataset import all_prompts
from server.demo.evaluate import classify
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.requests.step_cache import OFF, StepCache
from tests.support.tiny_pipelines import build_flux_folder, build_sd3_folder, build_sd15_folder

INTERVALS = (2, 3, 5)
THRESHOLDS = (0.05, 0.08, 0.15, 0.25, 0.35, 0.5)  # a tiny random MMDiT moves 18-50% a step
# a tiny random FLUX.1's first block moves 20-36% a step: 0.08 (the default) reuses nothing, 0.75
# reuses every step after the first
FLUX_THRESHOLDS = (0.08, 0.25, 0.3, 0.35, 0.5, 0.75)
MAX_DROP = 0.03  # accuracy points the default may lose
BATCH = 8
OVER = 10.0  # mean abs. difference (0-255) past which an image counts as visibly off
DEFAULT = "deep_3"  # the `deep` policy a request gets by name: interval 3


def run(pipeline: Pipeline, requests: list[GenerationRequest]) -> tuple[list[np.ndarray], float]:
    """Images in [0, 255] for `requests`, 8 stepped together, and the share of rows that reused."""
    images, reused, steps = [], 0, 0

    def count(states) -> None:
        nonlocal reused, steps
        for state in states:
            reused += state.cache.last == "reused"
            steps += state.cache.last is not None

    for start in range(0, len(requests), BATCH):
        batch = pipeline.generate(requests[start : start + BATCH], on_step=count)
        images += [image * 255 for image in batch]
    return images, reused / steps if steps else 0.0


def difference(images: list[np.ndarray], reference: list[np.ndarray]) -> dict[str, float]:
    diffs = [np.abs(a - b) for a, b in zip(images, reference, strict=True)]
    return {"mean_abs_diff": round(float(np.mean(diffs)), 3), "max_abs_diff": round(float(np.max(diffs)), 1)}


def per_image(
    images: list[np.ndarray], reference: list[np.ndarray], prompts: list[tuple[str, str, str, int]]
) -> dict[str, Any]:
    """Each image's mean abs. difference to its uncached twin, summarised: the worst prompt × seed,
    the median and 90th percentile, and the share over OVER/255."""
    diffs = np.array([np.abs(a - b).mean() for a, b in zip(images, reference, strict=True)])
    worst = int(diffs.argmax())
    return {
        "worst": {
            "prompt": prompts[worst][2],
            "seed": prompts[worst][3],
            "mean_abs_diff": round(float(diffs[worst]), 2),
        },
        "per_image_p50": round(float(np.median(diffs)), 2),
        "per_image_p90": round(float(np.percentile(diffs, 90)), 2),
        f"share_over_{OVER:g}": round(float(np.mean(diffs > OVER)), 4),
        "_worst_index": worst,  # for --worst; dropped before printing
    }


def save_worst(folder: Path, name: str, off: np.ndarray, cached: np.ndarray) -> None:
    """`worst_{name}_off.png` and `worst_{name}_cached.png`: the pair to look at."""
    folder.mkdir(parents=True, exist_ok=True)
    for label, image in (("off", off), ("cached", cached)):
        Image.fromarray(image.round().astype(np.uint8)).save(folder / f"worst_{name}_{label}.png")


def built_in(seeds: int, grid: Path | None, worst: Path | None = None) -> dict[str, Any]:
    pipeline = Pipeline.load(MODEL_DIR, devices="cpu")
    prompts = [(color, shape, text, seed) for color, shape, text in all_prompts() for seed in range(seeds)]
    policies = {"off": OFF, **{f"deep_{n}": StepCache("deep", n) for n in INTERVALS}}
    results, shown = {}, {}
    for name, policy in policies.items():
        requests = [GenerationRequest(text, seed=seed, step_cache=policy) for _, _, text, seed in prompts]
        images, reused = run(pipeline, requests)
        verdicts = [classify(image.round().astype(np.uint8)) for image in images]
        colors = [v.color == color for v, (color, *_) in zip(verdicts, prompts, strict=True)]
        shapes = [v.shape == shape for v, (_, shape, *_) in zip(verdicts, prompts, strict=True)]
        row = {
            "color_accuracy": round(float(np.mean(colors)), 4),
            "shape_accuracy": round(float(np.mean(shapes)), 4),
            "reused_share": round(reused, 3),
        }
        if name != "off":
            row.update(difference(images, shown["off"]))
            spread = per_image(images, shown["off"], prompts)
            index = spread.pop("_worst_index")
            row.update(spread)
            if worst is not None and name == DEFAULT:
                save_worst(worst, name, shown["off"][index], images[index])
        shown[name], results[name] = images, row
        print(json.dumps({"model": "built_in", "policy": name, "images": len(images), **row}))
    if grid is not None:
        side_by_side(shown, prompts, seeds).save(grid)
    return results


def side_by_side(shown: dict[str, list[np.ndarray]], prompts: list, seeds: int) -> Image.Image:
    """Seed 0 of every prompt (columns), one row per policy, labelled."""
    cell, label = 64, 64
    picked = [i for i, p in enumerate(prompts) if p[3] == 0]
    out = Image.new("RGB", (label + cell * len(picked), cell * len(shown)), "black")
    draw = ImageDraw.Draw(out)
    for row, (name, images) in enumerate(shown.items()):
        draw.text((2, row * cell + cell // 2 - 5), name, fill="white")
        for col, i in enumerate(picked):
            out.paste(Image.fromarray(images[i].round().astype(np.uint8)), (label + col * cell, row * cell))
    return out


def tiny(kind: str, folder: Path, seeds: int) -> list[dict[str, Any]]:
    pipeline = Pipeline.load(folder, devices="cpu")
    if kind == "sd15":
        policies = [StepCache("deep", n) for n in (2, 3, 4, 5, 8)]
    else:
        thresholds = FLUX_THRESHOLDS if kind == "flux" else THRESHOLDS
        policies = [StepCache("first_block", threshold=t) for t in thresholds]
    base = [
        GenerationRequest("a red circle", seed=seed, steps=20, guidance_scale=5.0) for seed in range(seeds)
    ]
    reference, _ = run(pipeline, base)
    rows = []
    for policy in policies:
        images, reused = run(pipeline, [GenerationRequest(**{**vars(r), "step_cache": policy}) for r in base])
        row = {"model": f"tiny_{kind}", "policy": str(policy), "reused_share": round(reused, 3)}
        rows.append({**row, **difference(images, reference)})
        print(json.dumps(rows[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 seed a prompt, 2 seeds on the tiny folders")
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0..N-1 per prompt (--quick: 1)")
    parser.add_argument("--grid", type=Path, help="save seed 0 of every prompt, a row per policy, here")
    parser.add_argument("--worst", type=Path, help=f"save {DEFAULT}'s worst image and its uncached twin here")
    args = parser.parse_args(argv)
    if args.seeds <= 0:
        parser.error(f"--seeds must be positive, got {args.seeds}")
    seeds = 1 if args.quick else args.seeds
    results = built_in(seeds, args.grid, args.worst)
    with tempfile.TemporaryDirectory() as tmp:
        tables = {
            "tiny_sd15": tiny("sd15", build_sd15_folder(Path(tmp) / "sd15"), 2 if args.quick else 8),
            "tiny_sd3": tiny("sd3", build_sd3_folder(Path(tmp) / "sd3"), 2 if args.quick else 8),
            "tiny_flux": tiny("flux", build_flux_folder(Path(tmp) / "flux"), 2 if args.quick else 8),
        }
    off, default = results["off"], results["deep_3"]
    drops = {k: round(off[k] - default[k], 4) for k in ("color_accuracy", "shape_accuracy")}
    worst = {name: row["worst"] for name, row in results.items() if "worst" in row}
    summary = {
        "summary": True,
        "seeds": seeds,
        "built_in": results,
        "default_drop": drops,
        "worst_image": worst,  # the figure to quote: each policy's worst prompt × seed
        **tables,
    }
    print(json.dumps({**summary, "meets_target": all(d <= MAX_DROP for d in drops.values())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
