"""The scheduler table (docs/api.md, "Schedulers"). Every family's tiny folder ships the scheduler
its published folders ship, config key for key; each row (a family and a scheduler: the folder's
own, one a request names, or another class a folder may ship) draws what the family's diffusers
pipeline draws given that scheduler, within 2/255 (most agree to 1e-6). A new family, or a
scheduler a family takes, is one more row. Folders that ship a scheduler no row holds are refused
at load, naming the class and what to do."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch

from server.errors import ModelFolderError
from server.pipeline import Pipeline
from server.pipeline.loading.folder import read_family
from server.pipeline.steps.schedulers import DDPM_FOLDER_SCHEDULERS, SCHEDULER_NAMES, make_scheduler
from server.requests import GenerationRequest

# DEIS's step calls numpy on tensors, which numpy 2 warns will change
pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")
BOUND = 2 / 255  # of float images in [0, 1]


@dataclass(frozen=True)
class Kind:
    """A family's diffusers pipeline and what it is called with beside the prompt, seed and size."""

    pipeline: str  # its class in diffusers
    knobs: Callable[[GenerationRequest], dict[str, Any]] = lambda r: {"guidance_scale": r.guidance_scale}
    loads: dict[str, Any] = field(default_factory=dict)  # from_pretrained's other arguments
    video: bool = False


KINDS = {
    "sd15": Kind("StableDiffusionPipeline"),
    "sdxl": Kind("StableDiffusionXLPipeline"),
    "sd3": Kind("StableDiffusion3Pipeline", loads={"text_encoder_3": None, "tokenizer_3": None}),
    "flux-dev": Kind(
        "FluxPipeline", lambda r: {"guidance_scale": r.guidance_scale, "true_cfg_scale": r.true_cfg_scale}
    ),
    "flux-schnell": Kind("FluxPipeline", lambda r: {"guidance_scale": r.guidance_scale}),
    "flux2": Kind("Flux2Pipeline"),
    "flux2-klein": Kind("Flux2KleinPipeline"),
    "qwen-image": Kind("QwenImagePipeline", lambda r: {"true_cfg_scale": r.true_cfg_scale}),
    "z-image": Kind("ZImagePipeline"),
    "wan2.1": Kind("WanPipeline", video=True),
    "wan2.2-a14b": Kind(
        "WanPipeline",
        lambda r: {"guidance_scale": r.guidance_scale, "guidance_scale_2": r.guidance_scale_2},
        video=True,
    ),
    "wan2.2-ti2v": Kind("WanPipeline", video=True),
}

IMAGE = GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=6, guidance_scale=4.0)
SMALL = {"width": 32, "height": 32}
VIDEO = {**SMALL, "frames": 9}


@dataclass(frozen=True)
class Row:
    kind: str
    request: GenerationRequest  # its `scheduler`: the name a request gives ("default": the folder's)
    ships: str | None = None  # another class the folder ships in place of its published one

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.ships or self.request.scheduler or 'default'}"


ROWS = [
    *(Row(kind, replace(IMAGE, scheduler=name)) for kind in ("sd15", "sdxl") for name in SCHEDULER_NAMES),
    # the other classes an SD-style folder may ship (fine-tunes and distillations do), its own
    *(Row("sd15", replace(IMAGE, steps=4), ships=c) for c in DDPM_FOLDER_SCHEDULERS if c != "PNDMScheduler"),
    Row("sd3", replace(IMAGE, steps=5)),
    Row("flux-dev", GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=3.5, **SMALL)),
    Row("flux-schnell", GenerationRequest("a blue triangle", seed=7, steps=3, guidance_scale=0.0, **SMALL)),
    *(
        Row(kind, GenerationRequest("a green square on a white table", seed=4, steps=3, **SMALL, **asked))
        for kind, asked in (
            ("flux2", {"guidance_scale": 2.5}),  # FLUX.2's pipelines take no negative prompt
            ("flux2-klein", {"guidance_scale": 3.0}),
            ("qwen-image", {"true_cfg_scale": 3.0, "negative_prompt": "blurry"}),
            ("z-image", {"guidance_scale": 3.0, "negative_prompt": "blurry"}),
        )
    ),
    Row("wan2.1", replace(IMAGE, **VIDEO)),
    Row("wan2.1", replace(IMAGE, steps=4, **VIDEO), ships="FlowMatchEulerDiscreteScheduler"),
    Row("wan2.2-a14b", replace(IMAGE, guidance_scale_2=2.0, **VIDEO)),
    Row("wan2.2-ti2v", replace(IMAGE, **VIDEO)),
]


@pytest.fixture(scope="module")
def folder_of(folders, sd3_folder, flux_folder, tiny_folder, tmp_path_factory) -> Callable[[Row], Path]:
    """A row's folder: the family's shared tiny folder, or a copy shipping the row's class."""
    shared = {**folders, "sd3": sd3_folder, "flux-dev": flux_folder}

    def folder(row: Row) -> Path:
        published = shared.get(row.kind) or tiny_folder(row.kind)
        if row.ships is None:
            return published
        return shipping(published, row.ships, tmp_path_factory.mktemp("ships") / row.id)

    return folder


def shipping(published: Path, class_name: str, copy: Path, **config: Any) -> Path:
    """A copy of `published` whose scheduler is `class_name`, made from its config (and `config`)
    as diffusers' from_config makes it: what a fine-tune's folder ships."""
    shutil.copytree(published, copy)
    own = json.loads((copy / "scheduler" / "scheduler_config.json").read_text())
    getattr(diffusers, class_name).from_config({**own, **config}).save_pretrained(copy / "scheduler")
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, "scheduler": ["diffusers", class_name]}))
    return copy


def theirs(kind: str, folder: Path, request: GenerationRequest) -> np.ndarray:
    """The family's diffusers pipeline on `folder`, given the request's scheduler as diffusers'
    users swap one in (`from_config` of the folder's)."""
    spec = KINDS[kind]
    pipe = getattr(diffusers, spec.pipeline).from_pretrained(folder, local_files_only=True, **spec.loads)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler(pipe.scheduler, request.scheduler or "default")
    negative = {} if request.negative_prompt is None else {"negative_prompt": request.negative_prompt}
    frames = {"num_frames": request.frames} if spec.video else {}
    out = pipe(
        prompt=request.prompt,
        **negative,
        **frames,
        num_inference_steps=request.steps,
        width=request.width,
        height=request.height,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
        **spec.knobs(request),
    )
    return out.frames[0] if spec.video else out.images[0]


def differs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.id)
def test_every_row_draws_its_familys_pipeline_given_that_scheduler(folder_of, row: Row) -> None:
    """Split over two stages where the denoiser splits, so the rows run through the shard's hooks."""
    folder = folder_of(row)
    pipeline = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    request = pipeline.resolve(row.request)
    if row.ships is not None:
        assert type(pipeline.components.scheduler).__name__ == row.ships
    ours, reference = pipeline.generate([request])[0], theirs(row.kind, folder, request)
    assert ours.shape == reference.shape
    assert differs(ours, reference) < BOUND, row.id
    assert float(reference.std()) > 0.05, "a flat image would hide differences"


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_mixed_schedulers_in_one_batch_each_draw_the_pipelines_image(folders, kind: str) -> None:
    """Requests joining at different steps with the multistep and stochastic schedulers beside the
    folder's own (SD 1.5's PNDM, SDXL's Euler) share denoiser calls, and each is the pipeline's
    image with its scheduler (and within 1e-3 of its own run alone)."""
    pipeline = Pipeline.load(folders[kind], devices="cpu,cpu", strategy="even")
    requests = [
        GenerationRequest("a red circle", seed=1, steps=6, guidance_scale=4.0, scheduler="euler_a"),
        GenerationRequest("a blue square", seed=2, steps=4, guidance_scale=1.0, scheduler="dpmpp_2m"),
        GenerationRequest("a green star", "red", seed=3, steps=5, guidance_scale=7.5, scheduler="ddim"),
        GenerationRequest("a white circle", seed=4, steps=3, guidance_scale=3.0),  # the folder's own
    ]
    requests = [pipeline.resolve(r) for r in requests]
    alone = [pipeline.generate([r])[0] for r in requests]
    first = pipeline.start(requests[:1])
    pipeline.step(first)
    pipeline.step(first)  # the first request is two steps ahead when the others join
    states = first + pipeline.start(requests[1:])
    calls = 0
    while active := [s for s in states if not s.done]:
        pipeline.step(active)
        calls += 1
    together = [image.numpy().copy() for image in pipeline.decode(states)]
    for state in states:
        state.close()

    # max(6 - 2, 4, 5, 3 + PNDM's first timestep twice): every call advanced every unfinished one
    assert calls == 5
    for request, solo, batched in zip(requests, alone, together, strict=True):
        assert differs(solo, batched) < 1e-3, request.scheduler
        assert differs(batched, theirs(kind, folders[kind], request)) < BOUND, request.scheduler
    assert differs(together[0], together[1]) > 0.05  # the requests really differ


def test_a_folder_shipping_a_scheduler_no_row_holds_is_refused_at_load(folders, flux_folder, tmp_path):
    """Named with the classes its family steps and how to pick one, before any weight loads."""
    cases = (
        (folders["sd15"], "CMStochasticIterativeScheduler", "PNDMScheduler"),
        (flux_folder, "EulerDiscreteScheduler", "FlowMatchEulerDiscreteScheduler"),
    )
    for published, class_name, accepted in cases:
        folder = shipping(published, class_name, tmp_path / class_name)
        with pytest.raises(ModelFolderError) as refused:
            read_family(folder)
        message = str(refused.value)
        assert class_name in message and accepted in message and "_class_name" in message
    index = json.loads((folders["sd15"] / "model_index.json").read_text())
    del index["scheduler"]
    scheduler_less = shutil.copytree(folders["sd15"], tmp_path / "no-scheduler")
    (scheduler_less / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="lists no scheduler"):
        read_family(scheduler_less)


def test_an_lcm_distilled_unet_is_refused_naming_what_to_serve_instead(folders, tmp_path) -> None:
    """Its pipeline feeds the UNet an embedding of the guidance scale, which diffshard does not."""
    folder = shutil.copytree(folders["sd15"], tmp_path / "lcm")
    config = json.loads((folder / "unet" / "config.json").read_text())
    (folder / "unet" / "config.json").write_text(json.dumps({**config, "time_cond_proj_dim": 256}))
    with pytest.raises(ModelFolderError, match=r"time_cond_proj_dim.*LCM LoRA"):
        read_family(folder)


@pytest.mark.filterwarnings("ignore:The configuration file of this scheduler:FutureWarning")
def test_an_outdated_ddim_config_is_stepped_as_stable_diffusion_pipeline_sets_it(folders, tmp_path) -> None:
    """Saved with clip_sample true and steps_offset 0, as early SD folders were: the pipeline sets
    both right when it is built, and so does the SD family."""
    folder = shipping(folders["sd15"], "DDIMScheduler", tmp_path / "old", clip_sample=True, steps_offset=0)
    pipeline = Pipeline.load(folder, devices="cpu")
    config = pipeline.components.scheduler.config
    assert (config.clip_sample, config.steps_offset) == (False, 1)
    request = pipeline.resolve(IMAGE)
    assert differs(pipeline.generate([request])[0], theirs("sd15", folder, request)) < BOUND


def test_the_openvino_peers_loop_makes_as_many_unet_calls_as_we_do(folders) -> None:
    """`benchmarks.peers.openvino_served` runs OpenVINO's parts in diffusers' loop: it steps the
    folder's own scheduler, as optimum-intel's pipeline does. DDIM over SD 1.5's PNDM config made
    10 UNet calls of an image to our 11, a tenth of the work spared to the peer."""
    from benchmarks.peers.openvino_served import folder_scheduler

    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    calls = []
    request = GenerationRequest("a red circle", seed=1, steps=10)
    pipeline.generate([pipeline.resolve(request)], on_step=lambda states: calls.append(len(states)))
    scheduler = folder_scheduler(folders["sd15"])
    scheduler.set_timesteps(10)
    assert type(scheduler).__name__ == type(pipeline.components.scheduler).__name__ == "PNDMScheduler"
    assert len(scheduler.timesteps) == len(calls) == 11
