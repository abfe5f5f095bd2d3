"""What is FLUX.1's own, on tiny dev- and schnell-shaped folders built from config under fixed
seeds: both equal diffusers' FluxPipeline split over 3 stages, requests joining at different
steps give the images they give alone, sizes and true CFG are checked by family, and FLUX.1-dev
plans at its published size. What every family is held to (alone, batched, two stages, a
sequence group, edits, LoRA, quantized, over HTTP) is tests/test_families.py's battery."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from diffusers import FluxPipeline

from server.errors import InvalidRequest
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from tests.conftest import Cli
from tests.support.tiny_pipelines import diffusers_image

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def flux_folders(flux_folder, tiny_folder) -> dict[str, Path]:
    """The shared tiny folders (conftest's)."""
    return {"dev": flux_folder, "schnell": tiny_folder("flux-schnell")}


def theirs(folder: Path, request: GenerationRequest) -> np.ndarray:
    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return diffusers_image(pipe, request, true_cfg_scale=request.true_cfg_scale or 1.0)  # unset: off


CASES = {  # dev's embedded guidance and true CFG, alone and beside others: tests/test_families.py
    "dev": GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=3.5, width=32, height=32),
    "schnell": GenerationRequest("a blue triangle", seed=7, steps=3, guidance_scale=0.0, width=32, height=32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dev_and_schnell_split_over_three_stages_equal_flux_pipeline(flux_folders, case: str) -> None:
    folder = flux_folders[case]
    pipeline = Pipeline.load(folder, devices="cpu,cpu,cpu", strategy="even")
    assert len(pipeline.shard.plan.stages) == 3
    request = pipeline.resolve(CASES[case])
    mine = pipeline.generate([request])[0]
    reference = theirs(folder, request)
    assert mine.shape == reference.shape == (request.height, request.width, 3)
    assert float(np.abs(mine - reference).max()) < TOLERANCE
    assert float(mine.std()) > 0.05  # not a flat image: the comparison means something


def test_requests_joining_at_different_steps_give_the_images_they_give_alone(flux_folders) -> None:
    pipeline = Pipeline.load(flux_folders["dev"], devices="cpu,cpu", strategy="even")
    first = GenerationRequest("a red circle", seed=1, steps=5, guidance_scale=2.0, width=32, height=32)
    later = GenerationRequest("a blue square", seed=2, steps=3, guidance_scale=4.0, width=32, height=32)
    alone = [pipeline.generate([r])[0] for r in (first, later)]
    states = pipeline.start([pipeline.resolve(first)])
    rows_per_call = []
    try:
        pipeline.step(states)
        pipeline.step(states)
        states += pipeline.start([pipeline.resolve(later)])
        while active := [s for s in states if not s.done]:
            rows_per_call.append(sum(s.rows for s in active))
            pipeline.step(active)
        together = [pipeline.decode([s])[0].numpy().copy() for s in states]
    finally:
        for state in states:
            state.close()
    assert rows_per_call[:3] == [2, 2, 2]  # one row each (embedded guidance), in one call
    for one, joined in zip(alone, together, strict=True):
        assert float(np.abs(one - joined).max()) < TOLERANCE


def test_sizes_and_true_cfg_are_checked_by_family(flux_folders, sd3_folder) -> None:
    flux = Pipeline.load(flux_folders["dev"], devices="cpu")
    with pytest.raises(InvalidRequest) as refused:  # 2x2 packing of a 2x VAE: multiples of 4
        flux.resolve(GenerationRequest("a red circle", width=30, height=32))
    assert refused.value.field == "size"
    assert flux.rows(flux.resolve(GenerationRequest("a red circle", guidance_scale=7.0))) == 1
    sd3 = Pipeline.load(sd3_folder, devices="cpu")
    with pytest.raises(InvalidRequest) as refused:
        sd3.resolve(GenerationRequest("a red circle", true_cfg_scale=3.0))
    assert refused.value.field == "true_cfg_scale"


FLUX_PLAN = ("plan", "--config", "flux-dev", "--dtype", "bfloat16")
TWO_4090S = ("--devices", "cuda:0,cuda:1", "--max-memory", "cuda:0=24GiB,cuda:1=24GiB")


def test_flux_dev_plans_for_two_24_gib_gpus_without_one_and_refuses_one_naming_the_shortfall(
    run_cli: Cli,
) -> None:
    """Two stages (auto takes a two-way tensor group there, T5 spread over both: test_tensor.py)."""
    started = time.monotonic()
    done = run_cli(*FLUX_PLAN, *TWO_4090S, "--parallel", "pipeline", "--json")
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert seconds < 20
    plan = json.loads(done.stdout)
    assert len(plan["stages"]) == 2 and all(len(stage["blocks"]) > 1 for stage in plan["stages"])
    assert sum(len(stage["blocks"]) for stage in plan["stages"]) == 1 + 19 + 38 + 1
    for device in plan["devices"]:  # weights, activations and (cuda:0) T5, CLIP and the VAE within budget
        used = device["param_bytes"] + device["activation_reserve"] + device["other_bytes"]
        assert used <= device["budget"], device
    assert plan["devices"][0]["other_bytes"] > 9e9  # T5-XXL's encoder (9.5 GB) sits with the first stage
    assert plan["boundaries"][0]["tensors"] == 5 and plan["boundaries"][0]["bytes"] > 0
    one = run_cli(*FLUX_PLAN, "--devices", "cuda:0", "--max-memory", "cuda:0=24GiB")
    assert one.returncode == 2 and "GiB short" in one.stderr and "cuda:0" in one.stderr
    unbudgeted = run_cli(*FLUX_PLAN, "--devices", "cuda:0,cuda:1")
    assert unbudgeted.returncode == 2 and "--max-memory cuda:0=" in unbudgeted.stderr
