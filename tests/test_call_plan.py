"""One engine path: every feature composes with every other, because each call carries its
plan (`server/engine/runtime/call.py`) and one block walker runs it.

Requests that each mix adapters, step caching and determinism differently, served in one batch,
give the images each gives alone (on an int8-dynamic base too); a lone request with an adapter
splits over an idle replica like any other (both workers busy) and gives the unsplit image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.requests import GenerationRequest
from server.requests.step_cache import StepCache
from server.serving import Service
from tests.support.denoisers import split_lone
from tests.support.lora import random_lora

TOLERANCE = 1e-3  # max abs difference of float images in [0, 1]
DEEP = StepCache("deep", interval=2)
STYLE = (("style", 0.8),)
FIRST_BLOCK = StepCache("first_block", threshold=0.5)  # a tiny random FLUX's first block moves a lot
MIXES = {  # (adapter, step cache, deterministic): four different combinations
    "adapter + cache": GenerationRequest("a red circle", seed=1, steps=6, lora=STYLE, step_cache=DEEP),
    "adapter + deterministic": GenerationRequest(
        "a blue square", seed=2, steps=6, lora=STYLE, deterministic=True
    ),
    "cache + deterministic": GenerationRequest(
        "a green star", seed=3, steps=6, step_cache=DEEP, deterministic=True
    ),
    "none": GenerationRequest("a red square", seed=4, steps=6),
}


@pytest.fixture(scope="module")
def style(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_lora(folders["sd15"], tmp_path_factory.mktemp("lora") / "style.safetensors", 1, "sd15")


def with_style(pipeline: Pipeline, style: Path) -> Pipeline:
    pipeline.add_adapter(read_adapter("style", style, pipeline.family))
    return pipeline


@pytest.mark.parametrize("quantize", ["off", "int8-dynamic"])
def test_four_mixes_in_one_batch_give_the_images_each_gives_alone(folders, style, quantize: str) -> None:
    """On a quantized base too: adapters apply in full precision beside its int8 layers."""
    pipeline = Pipeline.load(folders["sd15"], devices="cpu", quantize=quantize)
    service = Service(with_style(pipeline, style), "tiny", max_batch=16)
    try:
        alone = {name: service.submit([r]).future.result(timeout=120)[0] for name, r in MIXES.items()}
        before = dict(service.stats().batch_rows)
        jobs = {name: service.submit([r]) for name, r in MIXES.items()}  # queued together
        together = {name: job.future.result(timeout=120)[0] for name, job in jobs.items()}
        calls = {rows: n - before.get(rows, 0) for rows, n in service.stats().batch_rows.items()}
    finally:
        service.close()
    for name in MIXES:
        assert float(np.abs(together[name] - alone[name]).max()) < TOLERANCE, name
    # the two that may share a call did (4 rows a call); each deterministic one ran alone (2 rows)
    print("rows per call → calls, the four together:", dict(sorted(calls.items())))
    assert calls.get(4, 0) >= 5 and calls.get(2, 0) >= 2 * 6, calls


def test_a_lone_request_with_an_adapter_splits_over_an_idle_replica(folders, style) -> None:
    request = [GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=5.0, lora=STYLE)]
    unsplit = with_style(Pipeline.load(folders["sd15"], devices="cpu"), style).generate(request)[0]
    image, busy, stats = split_lone(folders["sd15"], request, lambda pipeline: with_style(pipeline, style))
    assert abs(image - unsplit).max() <= 1e-3
    assert set(busy) == {"cpu:0", "cpu:1"} and min(busy.values()) > 0, busy
    assert stats.adapter_rows["style"] > 0  # its rows ran with the adapter


def test_flux_first_block_reuses_rows_and_a_request_joining_a_busy_batch_gives_its_image_alone(
    flux_folder: Path,
) -> None:
    cached = GenerationRequest("a red circle", seed=5, steps=8, step_cache=FIRST_BLOCK)
    busy = GenerationRequest("a blue square", seed=6, steps=16)
    service = Service(Pipeline.load(flux_folder, devices="cpu"), "tiny-flux", max_batch=16)
    try:
        alone = service.submit([cached]).future.result(timeout=120)[0]
        reused = service.stats().cache_rows["reused"]  # what /v1/stats shows as step_cache_rows
        running = service.submit([busy])
        joined = service.submit([cached]).future.result(timeout=120)[0]  # joins the busy batch
        running.future.result(timeout=120)
        calls = service.stats().batch_rows
    finally:
        service.close()
    assert reused > 0
    assert float(np.abs(joined - alone).max()) * 255 <= 2
    assert calls[2] > 0, calls  # it shared calls with the busy request (a row each: no CFG rows)
