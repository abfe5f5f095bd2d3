"""LTX-2 (issue 71), on the tiny folder `tests/support/tiny_ltx2.py` builds as published (its
scheduler's shift and terminal, connectors with learnable registers, an audio VAE and vocoder):
frames and sound equal to LTX2Pipeline's with every guidance pass (CFG, spatio-temporal,
modality isolation, rescale) and without; videos started apart stepping together, each as
alone; two stages and a sequence group as one device; folders and requests it cannot serve
refused naming why; a video job's MP4 with its sound and the WAV of it."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel
from PIL import Image

from server.errors import InvalidRequest, ModelFolderError
from server.media.videos import read_wav
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.requests import GenerationRequest
from server.requests.guidance import AudioVideoGuidance
from server.requests.step_cache import StepCache
from tests.support.denoisers import sequence_lane
from tests.support.images import first_frame
from tests.support.live import live_server
from tests.support.lora import random_transformer_lora
from tests.support.tiny_ltx2 import FRAME_RATE, FRAMES, SIDE, load_reference, ltx2_reference

# openai 3.x warns on every videos call that OpenAI's own (Sora) service is scheduled to close
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
VIDEO = {"width": SIDE, "height": SIDE, "frames": FRAMES, "fps": FRAME_RATE}
# Every pass on, the audio's scales apart from the video's (the pipeline's defaults but block 1:
# the tiny transformer has two)
GUIDED = AudioVideoGuidance(
    audio_scale=7.0,
    stg_scale=1.0,
    audio_stg_scale=0.5,
    modality_scale=3.0,
    audio_modality_scale=2.0,
    rescale=0.7,
    audio_rescale=0.5,
    stg_blocks=(1,),
)
PLAIN = AudioVideoGuidance(
    audio_scale=1.0,
    stg_scale=0.0,
    audio_stg_scale=0.0,
    modality_scale=1.0,
    audio_modality_scale=1.0,
    rescale=0.0,
    audio_rescale=0.0,
)


@pytest.fixture(scope="module")
def folder(tiny_folder) -> Path:
    return tiny_folder("ltx-2")


@pytest.fixture(scope="module")
def pipeline(folder: Path) -> Pipeline:
    return Pipeline.load(folder, devices="cpu")


@pytest.fixture(scope="module")
def reference(folder: Path):
    return load_reference(folder)


def made(pipeline: Pipeline, requests: list[GenerationRequest]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each request's frames [F, H, W, 3] and waveform [channels, samples], stepped together."""
    states = pipeline.start([pipeline.resolve(r) for r in requests])
    try:
        while active := [s for s in states if not s.done]:
            pipeline.step(active)
        pipeline.decode(states)
        return [(s.image.numpy().copy(), s.sound.numpy().copy()) for s in states]
    finally:
        for state in states:
            state.close()


def pipelines_clip(
    reference, request: GenerationRequest, g: AudioVideoGuidance
) -> tuple[np.ndarray, np.ndarray]:
    return ltx2_reference(reference, **pipelines_clip_args(request, g))


def pipelines_clip_args(request: GenerationRequest, g: AudioVideoGuidance) -> dict:
    """LTX2Pipeline's arguments for `request` at guidance `g`."""
    return dict(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        seed=request.seed,
        steps=request.steps,
        guidance_scale=request.guidance_scale,
        stg_scale=g.stg_scale,
        modality_scale=g.modality_scale,
        guidance_rescale=g.rescale,
        audio_guidance_scale=g.audio_scale,
        audio_stg_scale=g.audio_stg_scale,
        audio_modality_scale=g.audio_modality_scale,
        audio_guidance_rescale=g.audio_rescale,
        stg_blocks=g.stg_blocks or (),
    )


@pytest.mark.parametrize(
    ("steps", "guidance", "scale"),
    [(3, GUIDED, 3.0), (20, GUIDED, 3.0), (3, PLAIN, 1.0)],
    ids=["guided-3", "guided-20", "plain-3"],
)
def test_frames_and_sound_equal_ltx2_pipelines(pipeline, reference, steps, guidance, scale) -> None:
    """Frames within 2/255 and the waveform within 1e-3 (float, ±1) of LTX2Pipeline's, with
    the four passes (negative, perturbed, isolated beside the prompt's) and with the prompt's alone."""
    request = GenerationRequest(
        "a robot dancing",
        negative_prompt="blurry",
        seed=3,
        steps=steps,
        guidance_scale=scale,
        guidance=guidance,
        **VIDEO,
    )
    assert pipeline.rows(pipeline.resolve(request)) == (4 if guidance is GUIDED else 1)
    ((frames, sound),) = made(pipeline, [request])
    video, audio = pipelines_clip(reference, request, guidance)
    assert frames.shape == video.shape and sound.shape == audio.shape
    assert np.abs(frames - video).max() * 255 <= 2
    assert np.abs(sound - audio).max() <= 1e-3
    assert audio.std() > 0.01 and video.std() > 0.01  # not a constant a test would pass on


def test_videos_started_apart_step_together_each_as_alone(pipeline) -> None:
    """A guided video and a plain one, the second started two steps after the first, share
    every call once both run (4 + 1 rows), and each equals its video and sound alone (1e-3)."""
    first = pipeline.resolve(GenerationRequest("a robot dancing", seed=3, steps=5, guidance=GUIDED, **VIDEO))
    second = pipeline.resolve(
        GenerationRequest("a cat on a mat", seed=4, steps=4, guidance_scale=1.0, guidance=PLAIN, **VIDEO)
    )
    alone = [made(pipeline, [r])[0] for r in (first, second)]
    rows: list[int] = []
    states = pipeline.start([first])
    try:
        for _ in range(2):
            pipeline.step(states)
            rows.append(4)
        states += pipeline.start([second])
        while active := [s for s in states if not s.done]:
            rows.append(sum(s.rows for s in active))
            pipeline.step(active)
        pipeline.decode(states)
        together = [(s.image.numpy().copy(), s.sound.numpy().copy()) for s in states]
    finally:
        for state in states:
            state.close()
    assert rows == [4, 4, 5, 5, 5, 1]
    for (frames, sound), (frames_alone, sound_alone) in zip(together, alone, strict=True):
        assert np.abs(frames - frames_alone).max() < 1e-3
        assert np.abs(sound - sound_alone).max() < 1e-3


def test_two_stages_and_a_sequence_group_equal_one_device(pipeline, folder) -> None:
    """Within 2/255 (frames) and 1e-3 (sound) of one device, a video from text and one from a
    first frame (its video tokens' own timesteps) in the same calls: the blocks over two stages,
    and every block's tokens of both streams and both prompts split over a sequence group of two."""
    request = GenerationRequest("a robot dancing", seed=3, steps=3, guidance=GUIDED, **VIDEO)
    from_frame = GenerationRequest("a cat on a mat", seed=4, steps=3, reference=first_frame(), **VIDEO)
    one = made(pipeline, [request, from_frame])
    two = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    assert len(two.shard.plan.stages) == 2
    for other in (two, sequence_lane(folder)):
        for (frames, sound), (their_frames, their_sound) in zip(
            one, made(other, [request, from_frame]), strict=True
        ):
            assert np.abs(their_frames - frames).max() * 255 <= 2
            assert np.abs(their_sound - sound).max() <= 1e-3


def test_a_folder_it_cannot_step_as_one_tensor_is_refused_naming_why(folder: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(folder, tmp_path / "folder"))
    config = json.loads((copy / "transformer/config.json").read_text())
    (copy / "transformer/config.json").write_text(json.dumps({**config, "audio_in_channels": 8}))
    with pytest.raises(ModelFolderError, match="video and audio streams have 4 and 8 channels"):
        Pipeline.load(copy, devices="cpu")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"guidance": AudioVideoGuidance(stg_blocks=(2,))}, "guidance.stg_blocks"),
        ({"steps": 1}, "steps"),
    ],
)
def test_requests_it_cannot_make_are_refused_naming_the_field(pipeline, change, field) -> None:
    with pytest.raises(InvalidRequest) as refused:
        pipeline.resolve(GenerationRequest("a robot dancing", seed=3, **{**VIDEO, **change}))
    assert refused.value.field == field


def test_guidance_scales_outside_their_range_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequest) as refused:
        AudioVideoGuidance(rescale=1.5)
    assert refused.value.field == "guidance.rescale"
    with pytest.raises(InvalidRequest):
        AudioVideoGuidance(audio_scale=float("nan"))
    assert torch.isfinite(torch.tensor(GUIDED.audio_scale))


def test_a_video_job_over_the_sdk_has_its_sound_in_the_mp4_and_as_a_wav(folder, reference) -> None:
    """/v1/videos on an LTX-2 model: its MP4 holds one H.264 stream of the clip's 9 frames (at the
    model's 24 fps: 0.375 s) and one AAC stream as long as the track; `variant=audio` is the WAV of
    the track as generated, within 1e-3 of LTX2Pipeline's at that frame rate; the frames
    (`variant=frames`, lossless) within 2/255; the guidance object reaches the passes."""
    body = {
        "num_frames": FRAMES,
        "seed": 3,
        "num_inference_steps": 3,
        "negative_prompt": "blurry",
        "guidance": {**vars(GUIDED), "stg_blocks": [1]},
    }
    with live_server("--model", str(folder)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        video = client.videos.create_and_poll(
            prompt="a robot dancing", size=f"{SIDE}x{SIDE}", extra_body=body, poll_interval_ms=50
        )
        assert video.status == "completed", video.error
        mp4 = client.videos.download_content(video.id, variant="video").read()
        wav = client.videos.download_content(video.id, variant="audio").read()
        archive = client.videos.download_content(video.id, variant="frames").read()
        refused = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a cat", "guidance": {"stg": 1}})
    request = GenerationRequest(
        "a robot dancing", "blurry", seed=3, steps=3, guidance_scale=3.0, guidance=GUIDED, **VIDEO
    )
    frames_ref, sound_ref = pipelines_clip(reference, request, GUIDED)
    samples, rate = read_wav(wav)
    assert rate == 16000 and samples.shape == sound_ref.shape
    assert np.abs(samples - sound_ref).max() <= 1e-3
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        frames = np.stack([np.asarray(Image.open(io.BytesIO(z.read(n)))) for n in sorted(z.namelist())])
    assert int(np.abs(frames.astype(int) - (frames_ref * 255).round().astype(int)).max()) <= 2
    with av.open(io.BytesIO(mp4)) as container:
        (picture,), (track,) = container.streams.video, container.streams.audio
        assert (picture.codec_context.name, track.codec_context.name) == ("h264", "aac")
        assert track.rate == 16000 and track.channels == 2
        # the track as generated: the causal audio VAE's 4L - 3 mel frames (33 hops: 0.33 s) of the
        # L = round(0.375 s × 100 hops / 4) = 9 latents of the 0.375 s clip
        assert float(track.duration * track.time_base) == pytest.approx(samples.shape[1] / rate, abs=1e-3)
        latents = round(FRAMES / FRAME_RATE * rate / 160 / 4)
        assert samples.shape[1] == (4 * latents - 3) * 160
        assert picture.frames == FRAMES
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "guidance.stg"


def test_a_first_frame_makes_ltx2_image_to_videos_video_and_sound(pipeline, reference) -> None:
    """`reference` (input_reference) on the text-to-video folder: the frame re-compressed at CRF
    33 and held still as the first latent frame's tokens (timestep 0), as LTX2ImageToVideoPipeline
    does; frames within 2/255 and the sound within 1e-3, and a plain text-to-video beside it in
    the same calls equal to its video alone."""
    image = first_frame()
    request = GenerationRequest("a robot dancing", seed=3, steps=3, guidance=GUIDED, reference=image, **VIDEO)
    plain = GenerationRequest("a cat on a mat", seed=4, steps=3, guidance=GUIDED, **VIDEO)
    (frames, sound), (plain_frames, plain_sound) = made(pipeline, [request, plain])
    video, audio = ltx2_reference(
        reference, **pipelines_clip_args(pipeline.resolve(request), GUIDED), image=image
    )
    assert np.abs(frames - video).max() * 255 <= 2
    assert np.abs(sound - audio).max() <= 1e-3
    ((alone_frames, alone_sound),) = made(pipeline, [plain])
    assert np.abs(plain_frames - alone_frames).max() < 1e-3 and np.abs(plain_sound - alone_sound).max() < 1e-3


def test_ltx23_plans_on_one_80_gib_gpu_in_bfloat16_beside_gemma(run_cli) -> None:
    """`plan --config ltx-2.3`: its 48 blocks (35.4 GiB in bfloat16) fit one 80 GiB card beside
    Gemma 3 12B's language model, the connectors, both VAEs and the vocoder (27.1 GiB). (LTX-2's,
    35.2 GiB, is 6.5 GiB short at the default pixel limit and fits at 512²: docs/planning.md.)"""
    args = ("--devices", "cuda:0", "--max-memory", "cuda:0=80GiB", "--dtype", "bfloat16")
    done = run_cli("plan", "--config", "ltx-2.3", *args, "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    (stage,) = plan["stages"]
    assert stage["blocks"] == ["embed", *(f"transformer_blocks.{i}" for i in range(48)), "out"]
    (device,) = plan["devices"]
    assert 37e9 < device["param_bytes"] < 39e9 and 28e9 < device["other_bytes"] < 30e9


def test_a_lora_row_beside_plain_ones_equals_ltx2_pipeline_with_its_lora(folder, reference, tmp_path) -> None:
    """A rank-4 LoRA on the transformer's attention: a guided video asking for it (its four
    passes, the isolated one gated off in the same call) and a plain one in the same calls; the
    LoRA one within 2/255 (frames) and 1e-3 (sound) of LTX2Pipeline after load_lora_weights at
    that scale, the plain one of its video alone."""
    style = random_transformer_lora(LTX2VideoTransformer3DModel, folder, tmp_path / "style.safetensors")
    pipeline = Pipeline.load(folder, devices="cpu")
    pipeline.add_adapter(read_adapter("style", style, pipeline.family))
    styled = GenerationRequest(
        "a robot dancing", seed=3, steps=3, guidance=GUIDED, lora=(("style", 0.8),), **VIDEO
    )
    plain = GenerationRequest("a cat on a mat", seed=4, steps=3, guidance=GUIDED, **VIDEO)
    (frames, sound), (plain_frames, plain_sound) = made(pipeline, [styled, plain])
    ((alone_frames, alone_sound),) = made(pipeline, [plain])
    assert np.abs(plain_frames - alone_frames).max() < 1e-3 and np.abs(plain_sound - alone_sound).max() < 1e-3
    reference.load_lora_weights(style, adapter_name="style")
    reference.set_adapters(["style"], [0.8])
    try:
        video, audio = pipelines_clip(reference, pipeline.resolve(styled), GUIDED)
    finally:
        reference.delete_adapters(["style"])
    assert np.abs(frames - video).max() * 255 <= 2
    assert np.abs(sound - audio).max() <= 1e-3
    assert np.abs(frames - made(pipeline, [replace(styled, lora=())])[0][0]).max() * 255 > 2  # it changes it


def test_ltx23s_architecture_equals_its_pipeline_from_text_and_from_a_first_frame(tiny_folder) -> None:
    """LTX-2.3's blocks (gated attention, the prompt modulated by the timestep, the connectors
    projecting each stream's prompt): a video from text and one from a first frame, stepped in
    the same calls with every pass, each within 2/255 (frames) and 1e-3 (sound) of its pipeline."""
    folder = tiny_folder("ltx-2.3")
    pipeline, reference = Pipeline.load(folder, devices="cpu"), load_reference(folder)
    assert pipeline.shard.model.config.gated_attn and not pipeline.shard.model.config.use_prompt_embeddings
    text = GenerationRequest(
        "a robot dancing", negative_prompt="blurry", seed=3, steps=3, guidance=GUIDED, **VIDEO
    )
    framed = GenerationRequest(
        "a cat on a mat", seed=4, steps=3, guidance=GUIDED, reference=first_frame(), **VIDEO
    )
    for (frames, sound), request in zip(made(pipeline, [text, framed]), (text, framed), strict=True):
        image = {"image": request.reference} if request.reference is not None else {}
        video, audio = ltx2_reference(
            reference, **pipelines_clip_args(pipeline.resolve(request), GUIDED), **image
        )
        assert np.abs(frames - video).max() * 255 <= 2
        assert np.abs(sound - audio).max() <= 1e-3


def test_guidance_is_refused_by_a_model_without_sound(tiny_folder) -> None:
    from server.pipeline.loading.folder import read_family
    from server.pipeline.resolve import read_defaults, resolve

    folder = tiny_folder("wan2.1")
    family = read_family(folder)
    with pytest.raises(InvalidRequest) as refused:
        resolve(
            GenerationRequest("a cat", guidance=AudioVideoGuidance()), read_defaults(folder, family), family
        )
    assert refused.value.field == "guidance" and "makes sound" in refused.value.message


def test_first_block_caching_reuses_both_streams_beside_a_plain_video(pipeline) -> None:
    """A first-block-cached video (its first block's video residual decides; a reusing row adds
    both streams' kept residuals) and a plain one step together, each as alone (1e-3), the
    cached one reusing steps, its frames a little (on average under 5/255) off its uncached ones."""
    plain = pipeline.resolve(GenerationRequest("a cat on a mat", seed=4, steps=8, guidance=GUIDED, **VIDEO))
    cached = replace(plain, seed=3, step_cache=StepCache("first_block", 3, 0.5))
    alone = [made(pipeline, [r])[0] for r in (plain, cached)]
    states = pipeline.start([plain, cached])
    reused = 0
    try:
        while active := [s for s in states if not s.done]:
            pipeline.step(active)
            reused += states[1].cache.last == "reused"
        pipeline.decode(states)
        together = [(s.image.numpy().copy(), s.sound.numpy().copy()) for s in states]
    finally:
        for state in states:
            state.close()
    assert reused >= 1
    for (frames, sound), (frames_alone, sound_alone) in zip(together, alone, strict=True):
        assert np.abs(frames - frames_alone).max() < 1e-3 and np.abs(sound - sound_alone).max() < 1e-3
    ((uncached, uncached_sound),) = made(pipeline, [replace(cached, step_cache=StepCache())])
    drift = np.abs(together[1][0] - uncached).mean() * 255  # reuse's cost: a little, not nothing
    assert 0 < drift < 5 and np.abs(together[1][1] - uncached_sound).mean() < 0.02, drift
