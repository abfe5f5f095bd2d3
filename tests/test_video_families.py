"""The video families (Wan 2.1, Wan 2.2 A14B's two experts, Wan 2.2 TI2V-5B, HunyuanVideo-1.5) on
tiny folders built as published (their scheduler, VAE, config and encoders; tests/support/), each
held to its diffusers pipeline: text-to-video guided and not, image-to-video from a first frame,
videos joining a running one at later steps and a sequence group of two giving what they give
alone, and a clip decoded in diffusers' tiles. A family is a row of `CASES`; what is one family's
own (A14B's expert switch, TI2V's per-frame timesteps, bfloat16, LoRA, HunyuanVideo-1.5's quoted
text) stays in its own module (test_wan.py, test_wan22.py, test_hunyuan15.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from server.pipeline import Pipeline
from server.requests import GenerationRequest
from tests.support.denoisers import sequence_lane
from tests.support.tiny_hunyuan15 import SIDE as HUNYUAN_SIDE
from tests.support.tiny_hunyuan15 import hunyuan_video
from tests.support.tiny_wan22 import TI2V_SIZE, wan_video


@dataclass(frozen=True)
class Case:
    """A family's tiny folder (conftest's `tiny_folder` by the same name) and what it is asked."""

    side: int  # pixels a side: the smallest its VAE and patches take
    guidance: dict[str, float]  # a guided request's scales (A14B's second expert has its own)
    image_folder: str | None  # its image-to-video folder's `tiny_folder` name; None: the same folder
    reference: Callable[..., np.ndarray] = (
        wan_video  # its pipeline's video: (folder, request, image=, tiled=)
    )
    not_yet: frozenset[str] = frozenset()  # what it does not serve yet: "image", "sequence"

    def size(self, frames: int = 9) -> dict[str, Any]:
        return {"width": self.side, "height": self.side, "frames": frames}


CASES = {
    "wan2.1": Case(32, {"guidance_scale": 5.0}, "wan2.1-i2v"),
    "wan2.2-a14b": Case(32, {"guidance_scale": 4.0, "guidance_scale_2": 2.0}, "wan2.2-i2v-a14b"),
    "wan2.2-ti2v": Case(TI2V_SIZE, {"guidance_scale": 5.0}, None),
    "hunyuanvideo-1.5": Case(HUNYUAN_SIDE, {"guidance_scale": 6.0}, "hunyuanvideo-1.5-i2v", hunyuan_video),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tiny_folder: Callable[[str], Path]) -> tuple[str, Path, Pipeline]:
    """(name, folder, its pipeline on one CPU)."""
    folder = tiny_folder(request.param)
    return request.param, folder, Pipeline.load(folder, devices="cpu")


def alike(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("guided", [True, False], ids=["guided", "unguided"])
def test_text_to_video_equals_the_pipelines(family, guided: bool) -> None:
    """Guided: two rows a step (each expert's scale where there are two); unguided: one."""
    name, folder, pipeline = family
    case = CASES[name]
    scales = {name: scale if guided else 1.0 for name, scale in case.guidance.items()}
    request = pipeline.resolve(
        GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=3, **scales, **case.size())
    )
    mine, theirs = pipeline.generate([request])[0], case.reference(folder, request)
    assert mine.shape == theirs.shape == (9, case.side, case.side, 3)
    assert alike(mine, theirs) * 255 <= 2 and float(theirs.std()) > 0.05  # not flat: it means something


def test_image_to_video_equals_the_image_to_video_pipelines(family, tiny_folder) -> None:
    """From a first frame: Wan 2.1's CLIP image tokens and 20 mask-and-latent channels, A14B's
    latents and mask alone (no image encoder), TI2V's first latent frame held at timestep 0."""
    name, folder, pipeline = family
    case = CASES[name]
    if "image" in case.not_yet:
        pytest.skip(f"{name}: text-to-video only, so far")
    if case.image_folder is not None:
        folder = tiny_folder(case.image_folder)
        pipeline = Pipeline.load(folder, devices="cpu")
    frame = Image.new("RGB", (case.side, case.side), (200, 40, 40))
    request = pipeline.resolve(
        GenerationRequest(
            "a red circle",
            negative_prompt="blue",
            seed=3,
            steps=3,
            reference=frame,
            **case.guidance,
            **case.size(),
        )
    )
    mine, theirs = pipeline.generate([request])[0], case.reference(folder, request, frame)
    assert mine.shape == theirs.shape == (9, case.side, case.side, 3)
    assert alike(mine, theirs) * 255 <= 2 and float(theirs.std()) > 0.02


def test_videos_joining_at_later_steps_and_a_sequence_group_give_what_they_give_alone(family) -> None:
    """Two 6-step videos join a 20-step one at its 3rd and 5th steps (under the folder's UniPC,
    whose history each row keeps); one of them split by tokens over a sequence group of two."""
    name, folder, pipeline = family
    size = CASES[name].size()
    asked = (("a red circle", 3, 20, 5.0), ("a blue square", 4, 6, 5.0), ("a green line", 5, 6, 1.0))
    requests = [
        pipeline.resolve(GenerationRequest(p, seed=s, steps=n, guidance_scale=g, **size))
        for p, s, n, g in asked
    ]
    alone = [pipeline.generate([r])[0] for r in requests]
    states = pipeline.start(requests[:1])
    try:
        for joining in requests[1:]:
            for _ in range(2):
                pipeline.step([s for s in states if not s.done])
            states += pipeline.start([joining])
        while active := [s for s in states if not s.done]:
            pipeline.step(active)
        pipeline.decode(states)
        for state, video in zip(states, alone, strict=True):
            assert alike(state.image.numpy(), video) < 1e-3
    finally:
        for state in states:
            state.close()
    if "sequence" in CASES[name].not_yet:
        return  # its spec splits no tokens yet
    lane = sequence_lane(folder)
    assert alike(lane.generate([requests[1]])[0], alone[1]) < 1e-3
    assert lane.lane.groups.calls == requests[1].steps  # every expert's calls (A14B: both) counted


def test_a_clip_decoded_in_tiles_equals_the_pipelines_tiled_decode(family) -> None:
    """`--vae-tiling on` (or auto, over the reserve): diffusers' own tiles (256 px), as WanPipeline
    decodes after `vae.enable_tiling()`; 512 px wide, so it tiles (decoded whole, it differs).
    Each VAE once: A14B's is Wan 2.1's, and on its latents (within 3e-6 of WanPipeline's) the tiny
    random decoder's tiles turn that into 0.05 at a tile's edge (measured; whole, 3e-5)."""
    name, folder, whole = family
    if name == "wan2.2-a14b":
        pytest.skip("Wan 2.1's VAE: its row")
    side = CASES[name].side
    request = GenerationRequest(
        "a red circle", seed=3, steps=2, guidance_scale=5.0, width=512, height=side, frames=5
    )
    tiled = Pipeline.load(folder, devices="cpu", vae_tiling=True)
    request = tiled.resolve(request)
    mine, theirs = tiled.generate([request])[0], CASES[name].reference(folder, request, tiled=True)
    assert alike(mine, theirs) * 255 <= 2
    assert alike(mine, whole.generate([request])[0]) * 255 > 10
