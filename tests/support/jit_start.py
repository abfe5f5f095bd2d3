"""A first start of the just-in-time compile route, in a fresh interpreter (`spawn`): what a
server's first start compiles, with no compile state left in the process by earlier tests (their
inductor settings would key its caches apart from a server's)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from server.demo import MODEL_DIR
from server.engine.runtime.compile import CompileMode
from server.pipeline import Pipeline
from server.pipeline.loading.warmup import compile_pipeline
from server.requests import GenerationRequest

REQUEST = GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=3, guidance_scale=4.0)


def first_start(cache: Path, threads: int) -> dict[str, Any]:
    """The built-in model's blocks compiled (float32, the 1- and 2-row buckets at 64²) into
    `cache`, its lane at `threads` intra-op threads as a server's: the compile's figures, and how
    far its image is from eager's."""
    pipeline = Pipeline.load(MODEL_DIR, devices="cpu")
    pipeline.lane_threads = threads
    request = pipeline.resolve(replace(REQUEST, width=64, height=64))
    eager = pipeline.generate([request])[0]
    stats = compile_pipeline(pipeline, CompileMode.BLOCKS, [64], 2, cache, route="jit")
    compiled = pipeline.generate([request])[0]
    (state,) = pipeline.start([request])
    state.close()
    return {**stats.view(), "difference": float(np.abs(compiled - eager).max()), "steps": state.steps}
