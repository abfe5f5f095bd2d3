"""What is Stable Diffusion 3's own (an MMDiT denoiser): requests joining a running service at
different steps equal their solo runs, its schedulers and sizes are checked, its plan names the
transformer's blocks, and an SD3 folder on two stages serves `n=2` and `/v1/shards`. Its images
against StableDiffusion3Pipeline (alone, batched, two stages, a sequence group, LoRA, quantized,
over HTTP) are tests/test_families.py's battery; its edits, tests/test_edits.py."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.serving import Service
from tests.support.live import live_server
from tests.support.waiting import wait_until

TOLERANCE = 1e-3


def test_requests_that_join_at_different_steps_equal_their_solo_runs(sd3_folder: Path) -> None:
    pipeline = Pipeline.load(sd3_folder, devices="cpu,cpu", strategy="even")
    jobs = [
        [GenerationRequest("a red circle", seed=1, steps=6, guidance_scale=4.0)],
        [GenerationRequest("a blue square", seed=2, steps=4, guidance_scale=1.0)],
        [GenerationRequest("a green star", "red", seed=3, steps=5, guidance_scale=7.0)] * 2,
        [GenerationRequest("a white circle", seed=5, steps=3, width=16, height=32)],
    ]
    alone = [pipeline.generate(requests) for requests in jobs]
    service = Service(pipeline, "tiny-sd3", max_batch=16)
    try:
        first = service.submit(jobs[0])
        progress = lambda: service.stats().progress.get(first.id, [(0, 0)])[0][0] >= 2  # noqa: E731
        wait_until(progress, 60, "the first request's second step")  # the others join two steps late
        together = [first] + [service.submit(requests) for requests in jobs[1:]]
        together = [job.future.result(timeout=120) for job in together]
        stats = service.stats()
    finally:
        service.close()
    for solo, batched in zip(alone, together, strict=True):
        for a, b in zip(solo, batched, strict=True):
            assert np.abs(a - b).max() < TOLERANCE
    assert max(stats.batch_rows) > 2  # requests really shared transformer calls
    assert pipeline.pool.stats()["cpu"].bytes_in_use == 0


def test_sd3_refuses_schedulers_and_sizes_its_family_cannot_run(sd3_folder: Path) -> None:
    pipeline = Pipeline.load(sd3_folder, devices="cpu")
    with pytest.raises(ValueError, match="scheduler: must be one of default for this model"):
        pipeline.resolve(GenerationRequest("a red circle", scheduler="ddim"))
    with pytest.raises(ValueError, match="multiples of 4"):  # VAE 2x, patch 2
        pipeline.resolve(GenerationRequest("a red circle", width=30, height=32))
    with pytest.raises(ValueError, match="at most 64"):  # the position embedding's 16x16 grid of patches
        pipeline.resolve(GenerationRequest("a red circle", width=96, height=32))


def test_plan_prints_the_sd3_medium_transformer_blocks() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "plan",
            "--config",
            "sd3",
            "--devices",
            "cpu,cpu",
            "--parallel",
            "pipeline",  # its two stages show the split
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    blocks = [b for stage in plan["stages"] for b in stage["blocks"]]
    assert blocks == ["embed", *(f"transformer_blocks.{i}" for i in range(24)), "out"]
    assert [s["device"] for s in plan["stages"]] == ["cpu", "cpu"]
    assert plan["boundaries"][0]["skips"] == []  # an MMDiT has no skip residuals


def test_an_sd3_folder_serves_through_the_images_api(sd3_folder: Path) -> None:
    with live_server("--model", str(sd3_folder), "--devices", "cpu,cpu") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        result = client.images.generate(
            prompt="a red circle", size="32x32", n=2, response_format="b64_json", extra_body={"seed": 3}
        )
        images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in result.data]
        assert [image.size for image in images] == [(32, 32)] * 2
        with pytest.raises(openai.BadRequestError, match="one of default for this model") as caught:
            client.images.generate(prompt="a red circle", extra_body={"scheduler": "ddim"})
        assert caught.value.param == "scheduler"
        shards = httpx.get(f"{server.url}/v1/shards").json()
        assert "transformer_blocks.0" in shards["plan"]["stages"][0]["blocks"]
        assert "ModelShard(SD3Transformer2DModel" in shards["text"]
