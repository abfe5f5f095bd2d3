"""Sample the built-in model with diffusers' own pipeline, score it, draw a grid.

    python -m server.demo.sampling [--model DIR] [--seeds 3] [--grid docs/samples.png]

prints the evaluator's color and shape accuracy over all 18 prompts x seeds (one JSON
object per prompt, a summary last) and optionally saves a labelled grid of the images.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from diffusers import StableDiffusionPipeline
from PIL import Image, ImageDraw

from server.demo import MODEL_DIR
from server.demo.dataset import COLORS, SHAPES, all_prompts
from server.demo.evaluate import classify


def load_pipeline(folder: Path = MODEL_DIR) -> StableDiffusionPipeline:
    """The folder as diffusers loads any Stable Diffusion folder: offline, safetensors only."""
    pipe = StableDiffusionPipeline.from_pretrained(folder, use_safetensors=True, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def recommended(folder: Path = MODEL_DIR) -> dict[str, Any]:
    """Sampling settings recorded beside the weights by the training script."""
    return json.loads((Path(folder) / "recommended.json").read_text())["recommended"]


def generate(
    pipe: StableDiffusionPipeline, prompts: list[str], seeds: list[int], steps: int, guidance: float
) -> list[Image.Image]:
    """One image per (prompt, seed), batched; each as `generator=Generator("cpu").manual_seed(seed)` gives."""
    generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
    size = pipe.unet.config.sample_size * pipe.vae_scale_factor
    return pipe(
        prompt=prompts,
        generator=generators,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=size,
        width=size,
    ).images


def score(pipe: StableDiffusionPipeline, seeds: list[int], steps: int, guidance: float) -> dict[str, Any]:
    """Color and shape accuracy over every prompt x seed, and the images (rows: prompts)."""
    rows, images = [], []
    for color, shape, prompt in all_prompts():
        batch = generate(pipe, [prompt] * len(seeds), seeds, steps, guidance)
        verdicts = [classify(image) for image in batch]
        rows.append(
            {
                "prompt": prompt,
                "color": sum(v.color == color for v in verdicts) / len(seeds),
                "shape": sum(v.shape == shape for v in verdicts) / len(seeds),
                "seen": [f"{v.color} {v.shape}" for v in verdicts],
            }
        )
        images.append(batch)
    n = len(rows)
    summary = {
        "color_accuracy": sum(r["color"] for r in rows) / n,
        "shape_accuracy": sum(r["shape"] for r in rows) / n,
        "images": n * len(seeds),
        "steps": steps,
        "guidance_scale": guidance,
        "scheduler": type(pipe.scheduler).__name__,
    }
    return {"prompts": rows, "summary": summary, "images": images}


def grid(images: list[list[Image.Image]], seeds: int) -> Image.Image:
    """Rows: colors; columns: shapes x seeds; labelled."""
    cell, label_w, label_h = 64, 56, 14
    out = Image.new("RGB", (label_w + cell * len(SHAPES) * seeds, label_h + cell * len(COLORS)), "black")
    draw = ImageDraw.Draw(out)
    for j, shape in enumerate(SHAPES):
        draw.text((label_w + j * cell * seeds + 4, 1), shape, fill="white")
    for i, color in enumerate(COLORS):
        draw.text((2, label_h + i * cell + cell // 2 - 5), color, fill="white")
        for j in range(len(SHAPES)):
            for k, image in enumerate(images[i * len(SHAPES) + j]):
                out.paste(image, (label_w + (j * seeds + k) * cell, label_h + i * cell))
    return out.resize((out.width * 2, out.height * 2), Image.NEAREST)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every prompt")
    parser.add_argument("--steps", type=int, help="default: the folder's recommended steps")
    parser.add_argument("--guidance", type=float, help="default: the folder's recommended guidance")
    parser.add_argument("--grid", type=Path, help="save a labelled PNG grid here")
    args = parser.parse_args(argv)
    settings = recommended(args.model)
    pipe = load_pipeline(args.model)
    result = score(
        pipe,
        list(range(args.seeds)),
        args.steps or settings["num_inference_steps"],
        args.guidance or settings["guidance_scale"],
    )
    for row in result["prompts"]:
        print(json.dumps(row))
    print(json.dumps({"summary": True, **result["summary"]}))
    if args.grid:
        grid(result["images"], args.seeds).save(args.grid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
