"""What compiling costs the images (`--compile`): the built-in model's graphs against eager calls,
in float32 and in bfloat16, under fixed seeds.

In float32 a compiled graph computes what eager code does up to rounding (the tests hold it to
1e-3). In bfloat16 a fused graph rounds at other places than eager code does, and those
differences grow over the steps: so bfloat16 is gated by quality, not by pixels. Columns:

- `float32_eager`: the reference;
- `float32_compiled`, `bfloat16_eager`, `bfloat16_compiled` (`bfloat16` only where this CPU runs it
  natively: `cpu_dtype()`): the built-in model compiled as `--compile full` compiles it (every
  bucket kept, where `auto` would keep only those measured faster), in a fresh cache directory.

Each column runs the evaluator's 6 colors × 3 shapes × N seeds (`server/demo/evaluate.py`) at the
recommended settings, BATCH requests stepped together as the server steps them: color and shape
accuracy, and the mean, 99th-percentile and max absolute pixel difference (0-255) to
`float32_eager`'s image of the same prompt and seed.

Target (`meets_target`): `float32_compiled` within 2/255 of `float32_eager` everywhere, and
`bfloat16_compiled` at 100% color and 100% shape accuracy (where bfloat16 runs).

    python -m benchmarks.quality.compile [--quick] [--seeds N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.demo import MODEL_DIR
from server.demo.dataset import all_prompts
from server.demo.evaluate import classify
from server.engine.hardware.devices import cpu_dtype
from server.engine.runtime.compile import CompileMode
from server.pipeline import Pipeline
from server.pipeline.loading.warmup import compile_pipeline
from server.requests import GenerationRequest

MAX_PIXELS_FLOAT32 = 2.0  # float32_compiled against float32_eager, in 0-255


def columns() -> dict[str, tuple[torch.dtype, bool]]:
    """Name → (dtype, compiled)."""
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_dtype() == torch.bfloat16 else [])
    return {
        f"{str(dtype).removeprefix('torch.')}_{'compiled' if graphs else 'eager'}": (dtype, graphs)
        for dtype in dtypes
        for graphs in (False, True)
    }


def images_of(
    dtype: torch.dtype, compiled: bool, requests: list, batch: int, cache: Path
) -> list[np.ndarray]:
    pipeline = Pipeline.load(MODEL_DIR, devices="cpu", dtype=dtype)
    stats = None
    if compiled:  # buckets up to a whole batch's rows (guided: 2 a request)
        rows = sum(pipeline.rows(pipeline.resolve(r)) for r in requests[:batch])
        stats = compile_pipeline(pipeline, CompileMode.FULL, [pipeline.defaults.size], rows, cache)
    out = []
    for start in range(0, len(requests), batch):
        out += [image * 255 for image in pipeline.generate(requests[start : start + batch])]
    if stats is not None:  # its calls: every one through a graph, or it says how many were not
        print(json.dumps({"dtype": str(dtype), **stats.view()}), flush=True)
    return out


def scored(images: list[np.ndarray], prompts: list, reference: list[np.ndarray]) -> dict[str, Any]:
    verdicts = [classify(image.round().astype(np.uint8)) for image in images]
    colors = [v.color == p[0] for v, p in zip(verdicts, prompts, strict=True)]
    shapes = [v.shape == p[1] for v, p in zip(verdicts, prompts, strict=True)]
    diff = np.abs(np.stack(images).astype(np.float64) - np.stack(reference).astype(np.float64))
    return {
        "color_accuracy": round(float(np.mean(colors)), 4),
        "shape_accuracy": round(float(np.mean(shapes)), 4),
        "mean_abs_diff": round(float(diff.mean()), 3),
        "p99_abs_diff": round(float(np.percentile(diff, 99)), 2),
        "max_abs_diff": round(float(diff.max()), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 requests a batch")
    parser.add_argument("--seeds", type=int, help="seeds per prompt (default 2; --quick 1)")
    args = parser.parse_args(argv)
    seeds, batch = args.seeds or (1 if args.quick else 2), 2 if args.quick else 8
    prompts = [(color, shape, text, seed) for color, shape, text in all_prompts() for seed in range(seeds)]
    requests = [GenerationRequest(text, seed=seed) for *_, text, seed in prompts]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as cache:
        images = {
            name: images_of(dtype, graphs, requests, batch, Path(cache))
            for name, (dtype, graphs) in columns().items()
        }
    for name, shown in images.items():
        results[name] = scored(shown, prompts, images["float32_eager"])
        print(json.dumps({"column": name, "images": len(shown), **results[name]}), flush=True)
    bf16 = results.get("bfloat16_compiled")
    meets = results["float32_compiled"]["max_abs_diff"] <= MAX_PIXELS_FLOAT32 and (
        bf16 is None or (bf16["color_accuracy"] == 1.0 and bf16["shape_accuracy"] == 1.0)
    )
    print(
        json.dumps(
            {
                "summary": True,
                "seeds": seeds,
                "batch": batch,
                "columns": results,
                "target": f"float32_compiled within {MAX_PIXELS_FLOAT32}/255 of float32_eager; "
                "bfloat16_compiled at 100% color and shape accuracy",
                "meets_target": meets,
                "bfloat16": "run" if bf16 else "not native on this CPU: not run",
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
