"""The GPU paths on a CPU-only build (issue 37): a model whose stages sit on fake `cuda:0` and
`cuda:1` runs generation, img2img and inpainting's start, a step's split forward with LoRA rows
and the step cache's walk, and the edits' first latents and blend with the VAE on another fake
GPU; a Wan video's rows over two fake GPUs and image-to-video's first frame from a VAE on
another (issue 41). Last, the issue's other GPU defects that a CPU can show.

PyTorch's own `FakeTensorMode` is the one fake here, at a true boundary: this build has no CUDA.
Its tensors carry shapes, dtypes and devices but no data, and it raises "Expected all tensors to
be on the same device, but found at least two devices, cuda:0 and cpu" exactly where CUDA would.
`FakeCuda` enters it only for calls that touch a fake (or name a CUDA device), so CPU work (image
preprocessing, the CPU generator's draws) runs for real, and routes four Python bindings to their
aten ops: `Tensor.__getitem__`, `__setitem__`, `copy_` and `contiguous` take a CUDA device guard
before dispatch, which a CPU build lacks ("not linked with support for cuda devices").

What it cannot cover, checked by reading instead (or on simulated GPUs, which carry data):
- data-dependent control flow (a value read from a fake tensor); the scheduler's step reads its
  timestep, which is on the host (`Pipeline._new_state`), so a step runs here;
- what a cross-device `copy_` does (here it is routed to `aten.copy_`, which fake mode accepts
  across devices, as CUDA does), pinned memory and streams (the pool pins only where CUDA is
  available), numbers (no data: images are compared with diffusers in test_edits.py);
- weights: models are built on the meta device; the edits' VAE gets fake weights from its meta
  tensors, and the pipeline's parts get uninitialised CPU storage that `ModelShard` and
  `Pipeline` move to the fake devices themselves (moving a fake parameter swaps tensors, which
  fake tensors' weak references refuse). No weight is ever read.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from diffusers import DDIMScheduler
from PIL import Image, ImageDraw
from transformers import CLIPTextModel

from server.demo.tokenizer import build_tokenizer
from server.engine import ModelShard, Workers, layout_of, plan_shards, run_micro_batches, spec_for
from server.engine.hardware.devices import worker_names
from server.engine.planning.calibrate import RUN_S
from server.engine.planning.calibrate import _rate as calibrate_rate
from server.engine.runtime.pool import ActivationPool
from server.pipeline import Pipeline
from server.pipeline.conditioning.adapters import Adapter, LoraPair
from server.pipeline.conditioning.edits import blend, first_latents
from server.pipeline.families.base import Family, ModelConfig
from server.pipeline.loading.folder import Components
from server.pipeline.steps.caching import keep
from server.pipeline.steps.state import RowCache
from server.requests import Edit, GenerationRequest
from server.requests.clip import Clip
from server.requests.generation import Defaults
from server.requests.step_cache import StepCache
from server.serving.calls import WatchedCalls
from tests.support.fake_cuda import FakeCuda
from tests.support.tiny_pipelines import IMAGE_SIZE, SD_SCHEDULE, TEXT_DIM, _text_config, _unet, _vae

SAME_DEVICE = "Expected all tensors to be on the same device"


def fake_weights(module: torch.nn.Module, device: str, fake: FakeCuda) -> torch.nn.Module:
    """`module` (built on meta) with every parameter and buffer a fake on `device`."""
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, t in list(store.items()):
                if t is not None:
                    f = fake.tensor(t, device)
                    store[name] = (
                        torch.nn.Parameter(f, requires_grad=False) if isinstance(t, torch.nn.Parameter) else f
                    )
    return module


def source() -> Image.Image:
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (20, 20, 30))
    ImageDraw.Draw(image).ellipse((2, 8, 14, 24), fill=(220, 30, 30))
    return image


def left_half() -> Image.Image:
    mask = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
    ImageDraw.Draw(mask).rectangle((0, 0, IMAGE_SIZE // 2 - 1, IMAGE_SIZE - 1), fill=255)
    return mask


def _meta_parts(channels: int) -> tuple[torch.nn.Module, torch.nn.Module, Family]:
    with torch.device("meta"):
        vae, unet = _vae(), _unet(cross_attention_dim=TEXT_DIM, in_channels=channels, out_channels=4)
    return vae, unet, Family(ModelConfig({}, dict(unet.config), dict(vae.config)))


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    with FakeCuda() as mode, torch.inference_mode():
        yield mode


def test_the_harness_raises_where_cuda_would(fake: FakeCuda) -> None:
    on0, on1 = fake.tensor(torch.empty(2, 3), "cuda:0"), fake.tensor(torch.empty(2, 3), "cuda:1")
    for other in (torch.ones(2, 3), on1):
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            _ = on0 + other
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            torch.cat([on0, other])
    assert (on0 + torch.tensor(2.0)).device == torch.device("cuda:0")  # a CPU scalar is allowed, as on CUDA
    assert on0.to("cuda:1").device == torch.device("cuda:1") and on0[:, None].shape == (2, 1, 3)


@pytest.mark.parametrize(
    ("channels", "masked", "strength"),
    [(4, False, 0.6), (4, True, 0.6), (9, True, 0.6), (9, True, 1.0), (9, False, 0.6)],
    ids=["img2img", "inpaint", "inpaint-unet", "inpaint-unet-full", "inpaint-unet-no-mask"],
)
def test_edits_start_and_blend_with_the_vae_on_another_fake_gpu(
    fake: FakeCuda, channels: int, masked: bool, strength: float
) -> None:
    """The VAE on cuda:1, the latents on cuda:0: the old edits code mixed the CPU generator's noise
    with the VAE's latents (`family.noised`) and the CPU mask with the masked image (`torch.cat`)."""
    vae, _, family = _meta_parts(channels)
    fake_weights(vae, "cuda:1", fake)
    device = torch.device("cuda:0")
    scheduler = DDIMScheduler(**SD_SCHEDULE)
    family.set_timesteps(scheduler, 4, device, family.latent_shape(IMAGE_SIZE, IMAGE_SIZE))
    edit = Edit(source(), left_half() if masked else None, strength)
    with ActivationPool().scope() as scope:
        start = first_latents(
            edit,
            family=family,
            vae=vae,
            scheduler=scheduler,
            first_t=scheduler.timesteps[1],
            generator=torch.Generator("cpu").manual_seed(0),
            scope=scope,
            width=IMAGE_SIZE,
            height=IMAGE_SIZE,
            device=device,
            dtype=torch.float32,
        )
        kept = start.inpainting
        made = [start.latents, start.conditioning, *([] if kept is None else vars(kept).values())]
        assert {t.device for t in made if t is not None} == {device}
        assert (kept is not None) == (masked and channels == 4)
        assert (start.conditioning is not None) == (channels == 9)
        if kept is not None:
            blend(family, scheduler, start.latents, kept, scheduler.timesteps[2])
            blend(family, scheduler, start.latents, kept, None)


def _fake_pipeline(
    fake: FakeCuda, channels: int, devices: tuple[str, ...] = ("cuda:0", "cuda:1")
) -> Pipeline:
    """A tiny SD pipeline whose UNet is split in two stages on fake `devices` (cuda:0 and cuda:1,
    or cuda:0 twice), its CLIP and VAE on cuda:0 (the first stage's device)."""
    vae, unet, family = _meta_parts(channels)
    tokenizer = build_tokenizer()
    with torch.device("meta"):
        clip = CLIPTextModel(_text_config(tokenizer))
    # planned on two CPU stages (the planner asks the host for its CUDA devices), then re-placed
    plan = plan_shards(unet, ["cpu", "cpu"], strategy="even")
    plan = replace(
        plan, stages=tuple(replace(s, device=d) for d, s in zip(devices, plan.stages, strict=True))
    )
    for model in (unet, vae, clip):
        model.to_empty(device="cpu")  # storage the moves below turn into fakes; never read
    components = Components(family, Path("."), unet, vae, (clip,), (tokenizer,), DDIMScheduler(**SD_SCHEDULE))
    defaults = Defaults(steps=3, guidance_scale=7.5, scheduler="default", size=IMAGE_SIZE)
    return Pipeline(components, ModelShard(unet, plan), defaults=defaults)


def _adapter() -> Adapter:
    """A rank-2 LoRA on the first and the last self-attention's query (real CPU tensors, as read)."""
    torch.manual_seed(0)
    pair = LoraPair(torch.randn(2, 32), torch.randn(32, 2), alpha=2.0)
    attention = "attentions.0.transformer_blocks.0.attn1.to_q"
    return Adapter("red", Path("red.safetensors"), {"unet": {f"{b}.{attention}": pair for b in TARGETS}})


TARGETS = ("down_blocks.0", "up_blocks.1")  # on cuda:0 and cuda:1


@pytest.mark.parametrize(
    ("channels", "devices"),
    [(4, ("cuda:0", "cuda:1")), (9, ("cuda:0", "cuda:1")), (4, ("cuda:0", "cuda:0"))],
    ids=["unet", "inpainting-unet", "unet-one-gpu-twice"],
)
def test_a_step_over_two_fake_gpus(fake: FakeCuda, channels: int, devices: tuple[str, ...]) -> None:
    """Two stages on cuda:0 and cuda:1, or both on cuda:0 (workers cuda:0#0 and cuda:0#1)."""
    pipeline = _fake_pipeline(fake, channels, devices)
    assert pipeline.shard.devices == list(dict.fromkeys(devices))
    assert pipeline.shard.gates.names == worker_names(devices)
    pipeline.add_adapter(_adapter())  # a layer on each stage: its pairs moved to that stage's device
    assert set(pipeline.adapters.bytes_on()) == set(devices)
    cache = StepCache("deep", interval=2)
    requests = [
        GenerationRequest("a red circle", seed=1, steps=3, lora=(("red", 0.8),)),
        GenerationRequest(
            "a red circle", seed=2, steps=3, guidance_scale=1.0, edit=Edit(source(), None, 0.7)
        ),
        GenerationRequest("a red circle", seed=3, steps=3, edit=Edit(source(), left_half(), 0.7)),
        GenerationRequest("a blue square", seed=4, steps=3, step_cache=cache),
    ]
    states = pipeline.start([pipeline.resolve(r) for r in requests])
    try:
        assert {s.latents.device for s in states} == {torch.device("cuda:0")}
        with pipeline.pool.scope() as batch:
            inputs = pipeline.stacked(states, batch)
            assert inputs.sample.shape == (7, channels, IMAGE_SIZE // 2, IMAGE_SIZE // 2)
            # one call: the LoRA rows' deltas on each stage's device, the cached request's deep
            # blocks; through both stages: cuda:0, then cuda:1, back
            result = pipeline.forward(inputs, pipeline.call_plan(states))
            assert result.out.device == torch.device("cuda:0") and result.out.shape == (7, 4, 16, 16)
            assert min(pipeline.shard.gates.stats().busy_s.values()) > 0  # both workers ran
            keep(states[-1], result.outcomes[-1])
            assert states[-1].cache.last == "refreshed"
            states[-1].index += 1  # its next step reuses what it kept (interval 2)
            reused = pipeline.forward(pipeline.stacked(states, batch), pipeline.call_plan(states))
            assert not reused.outcomes[-1].refreshed and reused.out.device == torch.device("cuda:0")
            states[-1].index -= 1
        # the scheduler's step reads its timestep on the host: it runs on the fake latents too
        pipeline.step(states[:1])
        assert states[0].index == 1 and states[0].latents.device == torch.device("cuda:0")
    finally:
        for state in states:
            state.close()


# Wan 2.1 (issue 41): a video's rows over two fake GPUs, and image-to-video's first frame.


def _wan_family(parts: dict) -> Family:
    from server.pipeline.families.wan import Wan, WanI2V

    model, vae = parts["transformer"], parts["vae"]
    kind = WanI2V if model.config.image_dim else Wan
    return kind(ModelConfig({"_class_name": kind.pipeline_classes[0]}, dict(model.config), dict(vae.config)))


def _wan(fake: FakeCuda) -> Pipeline:
    """Tiny Wan parts (tests/support/tiny_pipelines, CPU weights the moves turn into fakes): the
    transformer split over fake cuda:0 and cuda:1, UMT5 and the VAE on cuda:0."""
    from tests.support.tiny_pipelines import _wan_parts

    parts = _wan_parts()
    model = parts["transformer"]
    plan = plan_shards(model, ["cpu", "cpu"], strategy="even")
    plan = replace(plan, stages=tuple(replace(s, device=f"cuda:{i}") for i, s in enumerate(plan.stages)))
    components = Components(
        _wan_family(parts),
        Path("."),
        model,
        parts["vae"],
        (parts["text_encoder"],),
        (parts["tokenizer"],),
        parts["scheduler"],
    )
    defaults = Defaults(steps=3, guidance_scale=5.0, scheduler="default", size=32, clip=Clip(9, (32, 32), 4))
    return Pipeline(components, ModelShard(model, plan), defaults=defaults)


def test_a_video_step_over_two_fake_gpus(fake: FakeCuda) -> None:
    """A guided video and an unguided one with first-block caching in one call, the transformer
    on two fake GPUs: prompts encoded on cuda:0, latents made there, each stage on its own."""
    pipeline = _wan(fake)
    assert pipeline.shard.devices == ["cuda:0", "cuda:1"]
    requests = [
        GenerationRequest("a red circle", seed=1, steps=3, frames=9, width=32, height=32),
        GenerationRequest(
            "a blue square",
            seed=2,
            steps=3,
            frames=9,
            width=32,
            height=32,
            guidance_scale=1.0,
            step_cache=StepCache("first_block", threshold=0.5),
        ),
    ]
    states = pipeline.start([pipeline.resolve(r) for r in requests])
    try:
        assert {s.latents.device for s in states} == {torch.device("cuda:0")}
        with pipeline.pool.scope() as batch:
            inputs = pipeline.stacked(states, batch)
            assert inputs.sample.shape == (3, 16, 3, 4, 4)  # 9 frames: 3 latent frames of 4x4
            result = pipeline.forward(inputs, pipeline.call_plan(states))
            assert result.out.device == torch.device("cuda:0") and result.out.shape == (3, 16, 3, 4, 4)
    finally:
        for state in states:
            state.close()


def test_a_first_frame_is_encoded_on_the_vaes_fake_gpu_and_lands_with_the_latents(fake: FakeCuda) -> None:
    """Image-to-video: the reference frame encoded by a VAE on cuda:1, its mask made on the CPU,
    both beside noise drawn on the CPU: every tensor of the start on the latents' cuda:0."""
    from tests.support.tiny_pipelines import TEXT_DIM, _wan_parts

    parts = _wan_parts(in_channels=36, image_dim=TEXT_DIM, added_kv_proj_dim=24)
    vae, device = parts["vae"].to("cuda:1"), torch.device("cuda:0")
    family, scheduler = _wan_family(parts), parts["scheduler"]
    family.set_timesteps(scheduler, 3, device, family.latent_shape(32, 32, 9))
    with ActivationPool().scope() as scope:
        start = first_latents(
            None,
            family=family,
            vae=vae,
            scheduler=scheduler,
            first_t=scheduler.timesteps[0],
            generator=torch.Generator("cpu").manual_seed(0),
            scope=scope,
            width=32,
            height=32,
            device=device,
            dtype=torch.float32,
            frames=9,
            reference=source(),
        )
        assert start.latents.device == start.conditioning.device == device
        assert start.conditioning.shape == (1, 20, 3, 4, 4)  # the mask's 4 and the frame's 16 channels


# The other GPU defects of issue 37 that a CPU can show.


def test_each_block_is_handed_over_as_it_reaches_its_gpu_before_the_next_moves(fake: FakeCuda) -> None:
    """`placed` (float8's per-block conversion) runs on each block's module right after it moved
    to its stage's fake GPU, while every later block is still on the CPU: a device never holds
    more than one block unconverted, so a plan that fits only in float8 loads."""
    _, unet, _ = _meta_parts(4)
    plan = plan_shards(unet, ["cpu", "cpu"], strategy="even")
    devices = ("cuda:0", "cuda:1")
    plan = replace(
        plan, stages=tuple(replace(s, device=d) for d, s in zip(devices, plan.stages, strict=True))
    )
    unet.to_empty(device="cpu")
    paths = [path for block in layout_of(unet).blocks for path in block.modules]
    seen: list[tuple[str, set[str], set[str]]] = []  # a part, where it is, where the later ones are

    def where(paths: list[str]) -> set[str]:
        return {p.device.type for name in paths for p in unet.get_submodule(name).parameters()}

    def placed(module: torch.nn.Module, path: str) -> None:
        seen.append((path, where([path]), where(paths[paths.index(path) + 1 :])))

    ModelShard(unet, plan, placed=placed)
    assert [path for path, _, _ in seen] == paths
    assert all(here <= {"cuda"} and later <= {"cpu"} for _, here, later in seen), seen
    assert any(here == {"cuda"} for _, here, _ in seen) and seen[0][2] == {"cpu"}


def test_a_cuda_error_after_start_returned_closes_the_states_it_opened(fake: FakeCuda) -> None:
    """`synchronize` is where an asynchronous CUDA error surfaces, after `start` returned: here
    waiting for an event itself raises (`NoEvent`). The old code left the scopes open."""
    pipeline = _fake_pipeline(fake, 4)
    closed = threading.Event()
    calls = WatchedCalls(
        pipeline,
        step_timeout_s=60,
        max_batch=4,
        native_pixels=IMAGE_SIZE**2,
        inject_faults=False,
        closed=closed,
        on_stuck=lambda why: None,
    )
    try:
        request = pipeline.resolve(GenerationRequest("a red circle", seed=1, steps=3))
        with pytest.raises((AssertionError, RuntimeError)):
            calls(pipeline.start, [request])
    finally:
        closed.set()
    assert pipeline.pool.stats()["cuda:0"].bytes_in_use == 0


def test_step_cache_bytes_read_while_the_loop_thread_inserts() -> None:
    """`LoopStats` sums `RowCache.nbytes` on another thread than the loop's, which inserts into
    `kept` mid-step: the insert is made here at the worst moment (as the reader iterates)."""
    cache = RowCache({"a": torch.zeros(2), "b": torch.zeros(3)})
    inserted: list[bool] = []

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code.co_name == "<genexpr>" and not inserted:  # the reader is iterating
            cache.kept["late"] = torch.zeros(4)  # the loop thread's insert
            inserted.append(True)
        return tracer

    sys.settrace(tracer)
    try:
        nbytes = cache.nbytes
    finally:
        sys.settrace(None)
    assert inserted and nbytes == 5 * 4  # the snapshot taken before the insert


def test_calibration_decides_shrinking_on_a_warm_run() -> None:
    """An op's first run pays for kernels and caches (CUDA: module loading, cuBLAS handles): the
    old code shrank every such op's shape on it."""
    scales: list[int] = []
    cold = [True]

    def make(scale: int) -> tuple[Callable[[], object], float]:
        scales.append(scale)

        def run() -> None:
            if cold.pop() if cold else False:  # once per process, as a GPU's first launch
                until = time.perf_counter() + 1.5 * RUN_S
                while time.perf_counter() < until:
                    pass
            torch.ones(4) @ torch.ones(4)

        return run, 1.0

    assert calibrate_rate(make, lambda: None) > 0
    assert scales == [1]


def test_split_steps_reuse_their_helper_threads() -> None:
    unet = _unet(cross_attention_dim=TEXT_DIM)
    shard = ModelShard(unet, plan_shards(unet, "cpu"))
    inputs = spec_for(unet).example_inputs(unet, 2, IMAGE_SIZE // 2, torch.float32, torch.device("cpu"))
    ran: list[threading.Thread] = []
    unet.conv_in.register_forward_pre_hook(lambda *_: ran.append(threading.current_thread()))
    workers = Workers(1)  # a lane's, started with it
    for _ in range(2):
        run_micro_batches([shard, shard], inputs, 2, workers=workers)
    workers.close()
    helpers = [t for t in ran if t is not threading.current_thread()]
    assert len(helpers) == 2 and helpers[0] is helpers[1]  # one thread, not one per step


def test_a_tensor_group_over_two_fake_gpus_keeps_each_ranks_weights_on_its_own(fake: FakeCuda) -> None:
    """Issue 52's GPU placement: a tiny FLUX.1 as a tensor group on fake cuda:0 and cuda:1, each
    rank's weights on its own device, each holding its half of a split layer. Not shown here:
    CUDA moves a Parameter in place (`set_data`), which is why ranks get Parameters of their own
    before placing (`own_parameters`, tested in test_tensor.py); fakes are swapped in, not set.
    A group's call runs its ranks on threads at once, and one FakeTensorMode cannot serve two
    threads: the exchanges' `.to(here)` are read instead, and `tests/test_gpu.py` runs the call."""
    from server.engine import build_shards, plan_parallel
    from tests.support.denoisers import tiny_transformers

    model, _ = tiny_transformers()["flux"]
    whole = model.transformer_blocks[0].attn.to_q.weight.shape
    plan = plan_parallel(model, ["cpu", "cpu"], "tensor")
    ranks = tuple(
        replace(r, stages=tuple(replace(s, device=f"cuda:{k}") for s in r.stages))
        for k, r in enumerate(plan.replicas)
    )
    shards = build_shards(model, replace(plan, replicas=ranks))
    for k, shard in enumerate(shards):
        assert {p.device for p in shard.model.parameters()} == {torch.device(f"cuda:{k}")}
        assert shard.model.transformer_blocks[0].attn.to_q.weight.shape == (whole[0] // 2, whole[1])
