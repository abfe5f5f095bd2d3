"""Wan 2.1 on its own (issue 41): a tiny `WanTransformer3DModel` (built from config, seed 0) as
blocks equals diffusers' forward, unsplit, over two stages (its root `scale_shift_table` placed
with the last block) and as a sequence group of 2 and 3 ranks; bfloat16, frames and sizes checked
against the model, images from a video model, videos and images stepped together, adapters with
step caching and int8, and the plans at published sizes. What every video family is held to
(WanPipeline's videos guided and not, image-to-video, joining, a sequence group, tiled decode) is
tests/test_video_families.py's battery."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel

from server.engine import CallPlan, ModelShard, layout_of, plan_shards
from server.engine.denoisers.blocks import DenoiserInputs, TensorPart, part, tensor_bytes
from server.engine.runtime.replicas import Workers, sharing_weights
from server.engine.runtime.sequence import run_sequence
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.requests.clip import Clip
from tests.support.denoisers import tiny_wan, video_inputs
from tests.support.images import first_frame
from tests.support.lora import random_wan_lora
from tests.support.tiny_wan22 import wan_video


def diffusers_forward(model: WanTransformer3DModel, inputs: DenoiserInputs) -> torch.Tensor:
    with torch.inference_mode():
        return model(inputs.sample, inputs.timestep, inputs.context, return_dict=False)[0]


def test_the_layout_owns_every_tensor_once_the_root_table_with_the_output() -> None:
    model = tiny_wan()
    layout = layout_of(model)
    assert layout.names == ("embed", "blocks.0", "blocks.1", "blocks.2", "out")
    assert layout.blocks[-1].modules == ("norm_out", "proj_out", "scale_shift_table")
    table = part(model, "scale_shift_table")
    assert isinstance(table, TensorPart) and tensor_bytes(table) == model.scale_shift_table.numel() * 4
    table.to(torch.float64)  # a part moves (or casts) the model's own parameter, in place
    assert model.scale_shift_table.dtype == torch.float64
    plan = plan_shards(tiny_wan(), ["cpu"], "memory")
    assert sum(plan.stages[0].block_bytes) == tensor_bytes(model, torch.float32)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_our_blocks_equal_diffusers_forward(devices: list[str]) -> None:
    model, inputs = tiny_wan(), video_inputs()
    expected = diffusers_forward(model, inputs)
    shard = ModelShard(model, plan_shards(model, devices, "even"))
    assert len(shard.plan.stages) == len(devices) and shard.plan.stages[-1].blocks[-1] == "out"
    assert torch.equal(shard.run(inputs, CallPlan.plain(2)).out, expected)


@pytest.mark.parametrize("degree", [2, 3])  # 2 heads: Ulysses at 2, the keys and values gathered at 3
def test_a_video_split_over_a_sequence_group_equals_the_unsplit_call(degree: int) -> None:
    model, inputs = tiny_wan(), video_inputs()
    expected = diffusers_forward(model, inputs)
    shards = [ModelShard(model, plan_shards(model, ["cpu"], "memory"))]
    shards += [ModelShard(sharing_weights(model), shards[0].plan) for _ in range(degree - 1)]
    workers = Workers(degree - 1, 1)
    try:
        out = run_sequence(shards, shards[0].sequence, inputs, CallPlan.plain(2), workers.submit).out
    finally:
        workers.close()
    assert torch.allclose(out, expected, atol=1e-5), float((out - expected).abs().max())


# The Wan family: our pipeline against WanPipeline.

VIDEO = {"width": 32, "height": 32, "frames": 9}


@pytest.fixture(scope="module")
def wan_folder(tiny_folder):
    return tiny_folder("wan2.1")


def test_in_bfloat16_as_gpus_serve_it_the_vae_stays_float32_and_videos_follow_diffusers(wan_folder) -> None:
    """bfloat16, every GPU's default: the transformer computes in it though diffusers keeps its
    `scale_shift_table` in float32 (read as the model's dtype, the inputs were float32 and the
    first step failed); the VAE stays float32, as diffusers' examples load Wan's. A guided video
    runs; an unguided one follows WanPipeline in bfloat16 with that VAE, within its rounding
    (diffusers' scheduler step returns the model's dtype, so its latents round to bfloat16 at
    every step, ours stay float32: measured mean 0.15/255; guided, its guidance is bfloat16
    too and a tiny random model amplifies the gap: mean 2.4/255, 0.0 when ours rounds as it)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    pipeline = Pipeline.load(wan_folder, devices="cpu", dtype=torch.bfloat16)
    assert pipeline.vae.dtype == torch.float32 and pipeline.denoiser_dtype == torch.bfloat16
    guided = GenerationRequest("a red circle", seed=3, steps=3, guidance_scale=5.0, **VIDEO)
    video = pipeline.generate([pipeline.resolve(guided)])[0]
    assert video.shape == (9, 32, 32, 3) and np.isfinite(video).all()
    mine = pipeline.generate([pipeline.resolve(replace(guided, guidance_scale=1.0))])[0]
    vae = AutoencoderKLWan.from_pretrained(wan_folder, subfolder="vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(wan_folder, vae=vae, dtype=torch.bfloat16, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        prompt="a red circle",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=3,
        guidance_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
    ).frames[0]
    assert float(np.abs(mine - theirs).mean()) * 255 <= 1 and float(theirs.std()) > 0.05


def test_frames_are_checked_against_the_model(wan_folder) -> None:
    from server.errors import InvalidRequest
    from server.pipeline.families import reference_family
    from server.pipeline.resolve import read_defaults, resolve

    pipeline = Pipeline.load(wan_folder, devices="cpu")
    wan = reference_family("wan-1.3b")  # WanPipeline's default size, where the model runs it
    video, image = (
        resolve(GenerationRequest("a cat", frames=f), read_defaults(wan_folder, wan), wan) for f in (81, None)
    )
    assert (video.width, video.height, image.width, image.height) == (832, 480, 480, 480)
    video = pipeline.resolve(GenerationRequest("a cat", frames=9))  # 832 is past the tiny one's 512
    assert (video.width, video.height) == (480, 480)
    # past its RoPE's 32 positions an axis (tiny: rope_max_seq_len=32), as the model cannot run it
    with pytest.raises(InvalidRequest, match="at most 125 for this model, got 129"):
        pipeline.resolve(GenerationRequest("a cat", frames=129, width=32, height=32))
    with pytest.raises(InvalidRequest, match="at most 512 for this model, got 528x32"):
        pipeline.resolve(GenerationRequest("a cat", frames=9, width=528, height=32))
    pipeline.resolve(GenerationRequest("a cat", frames=125, width=512, height=32))  # the limits run
    with pytest.raises(InvalidRequest, match="1 more than a multiple of 4"):
        pipeline.resolve(GenerationRequest("a cat", frames=10, width=32, height=32))
    with pytest.raises(InvalidRequest, match="videos take neither"):
        pipeline.resolve(GenerationRequest("a cat", frames=9, width=32, height=32, partial_images=1))


def test_a_request_without_frames_is_an_image_as_wan_pipeline_draws_one_frame(wan_folder) -> None:
    """What the Images API asks a Wan model for: a one-frame video's frame, [H, W, 3]."""
    pipeline = Pipeline.load(wan_folder, devices="cpu")
    request = pipeline.resolve(GenerationRequest("a red circle", seed=5, steps=3, width=32, height=32))
    assert request.frames is None
    mine = pipeline.generate([request])[0]
    theirs = wan_video(wan_folder, replace(request, frames=1))
    assert mine.shape == (32, 32, 3) and theirs.shape == (1, 32, 32, 3)
    assert float(np.abs(mine - theirs[0]).max()) * 255 <= 2


def test_two_videos_and_two_images_stepped_together_equal_each_alone(wan_folder) -> None:
    """One Wan model's step loop: two 9-frame videos and two images (one-frame videos) queued
    together; each equals its alone output within 1e-3. Same-shape requests share a call: the
    videos' 4 rows (guided) in one, the images' 4 in another, every turn."""
    from server.serving import Service

    requests = [
        GenerationRequest("a red circle", seed=1, steps=3, guidance_scale=5.0, **VIDEO),
        GenerationRequest("a blue square", seed=2, steps=3, guidance_scale=5.0, **VIDEO),
        GenerationRequest("a red circle", seed=3, steps=3, guidance_scale=5.0, width=32, height=32),
        GenerationRequest("a blue square", seed=4, steps=3, guidance_scale=5.0, width=32, height=32),
    ]
    service = Service(Pipeline.load(wan_folder, devices="cpu"), "tiny-wan", max_batch=16)
    try:
        alone = [service.submit([r]).future.result(timeout=120)[0] for r in requests]
        before = dict(service.stats().batch_rows)
        jobs = [service.submit([r]) for r in requests]  # queued together
        together = [job.future.result(timeout=120)[0] for job in jobs]
        calls = {rows: n - before.get(rows, 0) for rows, n in service.stats().batch_rows.items()}
    finally:
        service.close()
    assert [a.shape for a in together] == [(9, 32, 32, 3)] * 2 + [(32, 32, 3)] * 2
    for mine, reference in zip(together, alone, strict=True):
        assert float(np.abs(mine - reference).max()) < 1e-3
    print("rows per call → calls, the four together:", dict(sorted(calls.items())))
    assert calls.get(4, 0) >= 2 * 2, calls  # each shape's two requests shared their calls


@pytest.mark.parametrize("scheduler", ["flow_match_euler", "unipc"])
def test_adapters_step_caching_and_int8_compose_for_videos(
    wan_folder, tmp_path_factory, tmp_path, scheduler: str
) -> None:
    """One engine path for video too: a LoRA video equals WanPipeline's after `load_lora_weights`;
    on an int8-dynamic base, a LoRA video, a first-block-cached video and a plain one stepped
    together each equal what they give alone, and the cached one reused rows. Under the published
    UniPC scheduler and flow-matching Euler (which folders of distilled Wan models ship). A row
    refreshing beside a reusing one takes the deep blocks' output as is: `carry + residual` is it
    only to a rounding, which int8's activations turn into a whole int8 step the next call."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from server.pipeline.conditioning.lora_keys import read_adapter
    from server.requests.step_cache import StepCache
    from server.serving import Service
    from tests.support.tiny_pipelines import build_wan_folder

    if scheduler == "flow_match_euler":
        euler = FlowMatchEulerDiscreteScheduler(shift=7.0)
        wan_folder = build_wan_folder(tmp_path_factory.mktemp("wan-euler") / "t2v", scheduler=euler)

    style = random_wan_lora(wan_folder, tmp_path / "style.safetensors", 1)
    styled = GenerationRequest(
        "a red circle", seed=3, steps=3, guidance_scale=5.0, lora=(("style", 0.8),), **VIDEO
    )
    pipeline = Pipeline.load(wan_folder, devices="cpu")
    pipeline.add_adapter(read_adapter("style", style, pipeline.family))
    mine = pipeline.generate([pipeline.resolve(styled)])[0]
    plain = pipeline.generate([pipeline.resolve(replace(styled, lora=()))])[0]
    theirs = wan_video(wan_folder, pipeline.resolve(styled), lora=(style, 0.8))
    assert float(np.abs(mine - theirs).max()) * 255 <= 2
    assert float(np.abs(mine - plain).max()) * 255 > 10  # the adapter changes the video

    requests = {
        "adapter": styled,
        "cached": GenerationRequest(
            "a blue square",
            seed=4,
            steps=6,
            guidance_scale=5.0,
            step_cache=StepCache("first_block", threshold=0.5),
            **VIDEO,
        ),
        "plain": GenerationRequest("a green star", seed=5, steps=3, guidance_scale=5.0, **VIDEO),
    }
    quantized = Pipeline.load(wan_folder, devices="cpu", quantize="int8-dynamic")
    quantized.add_adapter(read_adapter("style", style, quantized.family))
    service = Service(quantized, "tiny-wan", max_batch=16)
    try:
        alone = {name: service.submit([r]).future.result(timeout=120)[0] for name, r in requests.items()}
        reused = service.stats().cache_rows["reused"]
        jobs = {name: service.submit([r]) for name, r in requests.items()}  # queued together
        together = {name: job.future.result(timeout=120)[0] for name, job in jobs.items()}
        calls = service.stats().batch_rows
    finally:
        service.close()
    for name in requests:
        assert float(np.abs(together[name] - alone[name]).max()) < 1e-3, name
    assert reused > 0
    print("rows per call → calls:", dict(sorted(calls.items())))
    assert max(calls) >= 6, calls  # the three videos' guided rows shared calls


def test_wan_14b_plans_on_two_gpus_and_a_group_halves_a_lone_step(run_cli) -> None:
    """`plan --config wan-14b`: the published architecture on the meta device with UMT5-XXL and
    Wan's VAE beside it; a lone guided 81-frame 480² video's step as a group of two ≤ 0.6× one GPU's."""
    import json

    done = run_cli(
        "plan",
        "--config",
        "wan-14b",
        "--devices",
        "cuda:0,cuda:1",
        "--max-memory",
        "cuda:0=80GiB,cuda:1=80GiB",
        "--dtype",
        "bfloat16",
        "--max-batch",
        "2",
        "--parallel",
        "sequence",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["parallel"]["candidates"]
    group = next(c for c in found if c["sequence_degree"] == 2)
    one = next(c for c in found if c["note"].startswith("one device"))
    assert group["predicted_lone_step_s"] <= 0.6 * one["predicted_lone_step_s"], (group, one)


def test_a_clip_is_sized_against_its_own_default_and_within_max_pixels(tmp_path) -> None:
    from server.pipeline.families import reference_family
    from server.pipeline.resolve import read_defaults
    from server.requests.generation import size_warning
    from server.serving.limits import fit_defaults
    from server.settings import Settings
    from server.startup import request_limits

    family = reference_family("wan-1.3b")
    defaults = read_defaults(tmp_path, family)
    assert fit_defaults(defaults, request_limits(Settings(), family), family).video_size == (832, 480)
    square = request_limits(Settings(max_pixels=480 * 480), family)  # an operator's lower bound
    assert fit_defaults(defaults, square, family).video_size is None  # 480x480, not a refusal
    # a clip is warned about against its own native size, an image against the image's
    clip = GenerationRequest("a fox", frames=81, width=832, height=480)
    assert size_warning(clip, defaults) is None
    assert "(480x480)" in size_warning(replace(clip, frames=None), defaults)
    assert "(832x480)" in size_warning(replace(clip, width=256, height=256), defaults)


def test_a_video_longer_than_the_reserve_holds_is_refused_naming_the_longest(tmp_path) -> None:
    """A video's row is never split: Wan 14B planned for 8 rows of the 81-frame clip at 832x480's
    area (one 80 GiB GPU) holds a guided 832x480 video of at most 333 frames a step."""
    from server.errors import InvalidRequest
    from server.pipeline.families import reference_family
    from server.pipeline.resolve import read_defaults, with_defaults
    from server.serving.limits import check_limits
    from server.settings import Settings
    from server.startup import request_limits

    family = reference_family("wan-14b")
    limits, defaults = request_limits(Settings(max_batch=8), family), read_defaults(tmp_path, family)

    def video(frames: int) -> GenerationRequest:
        return with_defaults(GenerationRequest("a fox", frames=frames, steps=4), defaults)

    check_limits([video(333)], limits, family.rows)
    with pytest.raises(InvalidRequest, match=r"337 frames at 832x480 \(2 rows\) need more") as refused:
        check_limits([video(337)], limits, family.rows)
    assert "at most 333 frames at this size" in str(refused.value) and refused.value.field == "num_frames"
    check_limits([replace(video(337), guidance_scale=1.0)], limits, family.rows)  # one row: 665 frames


@pytest.mark.parametrize(
    "config, memory, rows, decoder",
    [
        ("wan-14b", "80GiB", 8, "669 frames: peak 10.0 GiB"),
        ("wan-1.3b", "24GiB", 4, "333 frames: peak 8.5 GiB"),
    ],
)
def test_wan_on_one_gpu_fits_its_batch_unless_one_is_asked(run_cli, config, memory, rows, decoder) -> None:
    """16 rows of 81-frame 832×480 video do not fit one GPU beside Wan's weights and UMT5: left
    to its default, --max-batch halves until the reserve fits (said); asked for, it is kept and
    the refusal says to lower it. The 3D VAE's peak, counted on meta at the longest clip the
    batch admits (rows × 21 latent frames; 81 frames alone: 7.4 GiB), decides its tiles."""
    args = (
        "plan",
        "--config",
        config,
        "--devices",
        "cuda:0",
        "--max-memory",
        f"cuda:0={memory}",
        "--dtype",
        "bfloat16",
    )
    fitted = run_cli(*args)
    assert fitted.returncode == 0, fitted.stderr
    assert f"batch={rows} " in fitted.stdout and f"a step runs at most {rows} rows" in fitted.stderr
    # the longest clip decoded whole: over 1.3B's reserve on 24 GiB, so it tiles
    tiles = (
        "tiles (a clip's whole peak is over"
        if config == "wan-1.3b"
        else "whole (a clip's whole peak is within"
    )
    assert f"VAE decoder at 624², {decoder} whole" in fitted.stdout and tiles in fitted.stdout
    if config == "wan-14b":
        asked = run_cli(*args, "--max-batch", "16")
        assert asked.returncode != 0 and "lower --max-batch" in asked.stderr, asked.stderr
        four = run_cli(*args, "--max-batch", "4")
        assert "batch=4 " in four.stdout and "--max-batch:" not in four.stderr


def test_a_first_frame_is_asked_where_the_model_takes_one_and_refused_elsewhere(
    wan_folder, tiny_folder
) -> None:
    from server.errors import InvalidRequest
    from server.pipeline.loading.folder import read_family
    from server.pipeline.resolve import resolve
    from server.requests.generation import Defaults

    t2v, i2v = read_family(wan_folder), read_family(tiny_folder("wan2.1-i2v"))
    defaults = Defaults(2, 5.0, "default", 32, 16, clip=Clip(9, (32, 32), 4))
    with pytest.raises(InvalidRequest, match="from text only") as refused:
        resolve(GenerationRequest("a cat", reference=first_frame(), **VIDEO), defaults, t2v)
    assert refused.value.field == "input_reference"
    with pytest.raises(InvalidRequest, match="from an image"):
        resolve(GenerationRequest("a cat", **VIDEO), defaults, i2v)
    assert resolve(GenerationRequest("a cat", reference=first_frame(), **VIDEO), defaults, i2v).resolved


def test_a_wan_image_streams_partial_images_as_images(wan_folder) -> None:
    """A video model's image (one frame) asked with partial images: each preview is [H, W, 3]
    like the final image (before: a 500 on a [3, 1, H, W] preview, counted as a failed step)."""
    pipeline = Pipeline.load(wan_folder, devices="cpu")
    request = pipeline.resolve(GenerationRequest("a cat", width=32, height=32, steps=4, partial_images=2))
    (state,) = states = pipeline.start([request])
    previews = []
    while not state.done:
        pipeline.step(states)
        if state.preview is not None:
            previews.append(tuple(state.preview[1].shape))
            state.preview = None
    pipeline.decode(states)
    assert previews == [(32, 32, 3)] * 2 and tuple(state.image.shape) == (32, 32, 3)
    state.close()
