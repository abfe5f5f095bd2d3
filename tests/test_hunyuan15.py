"""What is HunyuanVideo-1.5's own (issue 71), on the tiny folder `tests/support/tiny_hunyuan15.py`
builds as published: prompts with quoted text (ByT5's glyph tokens) and without, of different
lengths, batched in one call as each alone and as HunyuanVideo15Pipeline makes them; the
guider's scale as the default; two stages and sequence groups as one device; first-block
caching and int8 beside a plain video; image-to-video sized and cropped by its frame as
HunyuanVideo15ImageToVideoPipeline does; a video job over the openai SDK; `plan --config` at
the published size; folders it cannot serve as its pipeline does refused at load. Held to the
pipeline beside the other video families (guided and not, joining, tiled decode):
tests/test_video_families.py."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from server.engine.denoisers.hunyuan15 import GLYPH_MASK, GLYPHS
from server.errors import InvalidRequest, ModelFolderError
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.requests.step_cache import StepCache
from tests.support.denoisers import sequence_lane
from tests.support.images import source_image
from tests.support.live import live_server
from tests.support.tiny_hunyuan15 import GLYPH_DIM, GUIDANCE, SIDE, hunyuan_video

# openai 3.x warns on every videos call that OpenAI's own (Sora) service is scheduled to close
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
VIDEO = {"width": SIDE, "height": SIDE, "frames": 5}
QUOTED = 'a red sign saying "open" on a long white table'


@pytest.fixture(scope="module")
def folder(tiny_folder) -> Path:
    return tiny_folder("hunyuanvideo-1.5")


@pytest.fixture(scope="module")
def pipeline(folder: Path) -> Pipeline:
    return Pipeline.load(folder, devices="cpu")


def alike(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def test_quoted_text_reaches_the_glyph_encoder_and_the_video_is_the_pipelines(pipeline, folder) -> None:
    """A prompt with quotes gives ByT5's tokens of `Text "open". ` (its bytes and </s>); one
    without, zeros under an empty mask, as the pipeline encodes them."""
    parts = pipeline.components
    embeddings = pipeline.family.encode(pipeline.encoders, parts.tokenizers, [QUOTED, "a cat"])
    glyphs, masks = embeddings.rows[GLYPHS], embeddings.rows[GLYPH_MASK]
    assert glyphs.shape == (2, 256, GLYPH_DIM)
    assert int(masks[0].sum()) == len('Text "open". ') + 1 and int(masks[1].sum()) == 0
    assert not glyphs[1].any()
    request = pipeline.resolve(GenerationRequest(QUOTED, negative_prompt="blurry", seed=3, steps=3, **VIDEO))
    assert alike(pipeline.generate([request])[0], hunyuan_video(folder, request)) * 255 <= 2


def test_prompts_of_other_lengths_share_a_call_as_each_alone(pipeline) -> None:
    """A quoted prompt, a short one and a long one (their text columns cut to the call's longest)
    step in one call a step and each equals its video alone."""
    prompts = (QUOTED, "a cat", " ".join(["a green square on a long white table"] * 6))
    requests = [
        pipeline.resolve(GenerationRequest(p, seed=s, steps=3, guidance_scale=g, **VIDEO))
        for p, s, g in zip(prompts, (3, 4, 5), (6.0, 1.0, 4.0), strict=True)
    ]
    alone = [pipeline.generate([r])[0] for r in requests]
    rows: list[int] = []
    step = pipeline.step
    pipeline.step = lambda states: (rows.append(sum(s.rows for s in states)), step(states))[1]
    try:
        together = pipeline.generate(requests)
    finally:
        del pipeline.step
    assert rows == [5, 5, 5]  # two guided rows, one unguided, two guided: one call a step
    for mine, reference in zip(together, alone, strict=True):
        assert alike(mine, reference) < 1e-3


def test_the_guiders_scale_is_the_default_and_two_stages_give_one_devices_video(pipeline, folder) -> None:
    request = pipeline.resolve(GenerationRequest("a red circle", seed=3, steps=2, **VIDEO))
    assert request.guidance_scale == GUIDANCE == pipeline.family.default_guidance
    two = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    assert len(two.shard.plan.stages) == 2
    split, whole = (torch.from_numpy(p.generate([request])[0]) for p in (two, pipeline))
    assert torch.equal(split, whole)


@pytest.mark.parametrize(
    ("part", "change", "named"),
    [
        ("guider/guider_config.json", {"guidance_rescale": 0.7}, "guidance_rescale"),
        ("guider/guider_config.json", {"_class_name": "AdaptiveProjectedGuidance"}, "Adaptive"),
        ("transformer/config.json", {"task_type": "i2v"}, "task_type is 'i2v'"),
    ],
)
def test_a_folder_it_cannot_serve_as_its_pipeline_does_is_refused_naming_why(
    folder: Path, tmp_path: Path, part: str, change: dict, named: str
) -> None:
    copy = Path(shutil.copytree(folder, tmp_path / "folder"))
    config = json.loads((copy / part).read_text())
    (copy / part).write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelFolderError, match=named):
        Pipeline.load(copy, devices="cpu")


def test_a_video_job_over_the_sdk_equals_the_pipeline_and_models_shows_the_guiders_scale(folder) -> None:
    """/v1/videos as for Wan: the frames (lossless, `variant=frames`) within 2/255 of
    HunyuanVideo15Pipeline's, at the guider's scale when the request names none."""
    body = {"num_frames": 5, "seed": 3, "num_inference_steps": 3, "negative_prompt": "blurry"}
    with live_server("--model", str(folder)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        video = client.videos.create_and_poll(
            prompt=QUOTED, size=f"{SIDE}x{SIDE}", extra_body=body, poll_interval_ms=50
        )
        archive = client.videos.download_content(video.id, variant="frames").read()
        listed = client.models.list().data[0].model_extra
    assert video.status == "completed", video.error
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        frames = np.stack([np.asarray(Image.open(io.BytesIO(z.read(n)))) for n in sorted(z.namelist())])
    request = GenerationRequest(QUOTED, "blurry", seed=3, steps=3, guidance_scale=GUIDANCE, **VIDEO)
    theirs = (hunyuan_video(folder, request) * 255).round().astype(int)
    assert frames.shape == theirs.shape == (5, SIDE, SIDE, 3)
    assert int(np.abs(frames.astype(int) - theirs).max()) <= 2
    assert listed["family"]["name"] == "hunyuanvideo-1.5" and listed["defaults"]["guidance_scale"] == GUIDANCE


def test_the_480p_model_plans_on_one_80_gib_gpu_in_bfloat16_beside_its_encoders(run_cli) -> None:
    """`plan --config hunyuanvideo-1.5-480p`: the 8.3 B transformer's 54 blocks (16.7 GB in
    bfloat16) with Qwen2.5-VL-7B's language model, ByT5 and the VAE beside it (17.1 GB)."""
    args = ("--devices", "cuda:0", "--max-memory", "cuda:0=80GiB", "--dtype", "bfloat16", "--json")
    done = run_cli("plan", "--config", "hunyuanvideo-1.5-480p", *args)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    (stage,) = plan["stages"]
    assert stage["blocks"] == ["embed", *(f"transformer_blocks.{i}" for i in range(54)), "out"]
    (device,) = plan["devices"]
    assert 16e9 < device["param_bytes"] < 17e9 and 16e9 < device["other_bytes"] < 18e9
    assert device["param_bytes"] + device["activation_reserve"] + device["other_bytes"] <= device["budget"]


def test_first_block_caching_and_int8_compose_with_a_plain_video_in_one_call(folder) -> None:
    """On an int8-dynamic transformer and Qwen2.5-VL: a first-block-cached video (it reuses steps)
    and a plain one step together, each as it steps alone, both within a few 255ths of float32's."""
    quantized = Pipeline.load(
        folder, devices="cpu", quantize="denoiser=int8-dynamic,text_encoder=int8-dynamic"
    )
    plain = GenerationRequest("a red circle", seed=3, steps=6, guidance_scale=1.0, **VIDEO)
    cached = GenerationRequest(**{**vars(plain), "seed": 4, "step_cache": StepCache("first_block", 3, 0.2)})
    requests = [quantized.resolve(r) for r in (plain, cached)]
    alone = [quantized.generate([r])[0] for r in requests]
    states = quantized.start(requests)
    reused = 0
    try:
        while active := [s for s in states if not s.done]:
            quantized.step(active)
            reused += states[1].cache.last == "reused"
        quantized.decode(states)
        together = [s.image.numpy().copy() for s in states]
    finally:
        for state in states:
            state.close()
    assert reused >= 1
    for mine, reference in zip(together, alone, strict=True):
        assert alike(mine, reference) < 1e-3
    full = Pipeline.load(folder, devices="cpu")
    assert 0 < alike(alone[0], full.generate([full.resolve(plain)])[0]) * 255 < 8


@pytest.mark.parametrize("degree", [2, 3])  # 2 heads: Ulysses at 2, the keys and values gathered at 3
def test_a_sequence_group_gives_one_devices_videos_for_prompts_of_other_lengths(folder, degree: int) -> None:
    """Each rank a slice of the video and of the text tokens; the blocks' mask of token pairs
    taken as its keys' (`keys_of`): within 2/255 of one device, the quoted prompt's too."""
    lane = sequence_lane(folder, degree)
    alone = Pipeline.load(folder, devices="cpu")
    requests = [
        alone.resolve(GenerationRequest(p, seed=s, steps=2, **VIDEO)) for p, s in ((QUOTED, 3), ("a cat", 4))
    ]
    for split, whole in zip(lane.generate(requests), alone.generate(requests), strict=True):
        assert alike(split, whole) * 255 <= 2
    assert lane.lane.groups.calls == 2


def test_image_to_video_sizes_the_video_by_the_frame_and_crops_it_as_the_pipeline(tiny_folder) -> None:
    """A 2:1 first frame and no size: the video is `target_size`² pixels at the frame's aspect
    (80×48 here), the frame resized to cover it and cropped, its SigLIP tokens and latents as
    HunyuanVideo15ImageToVideoPipeline's: within 2/255. A text-only request is refused by name."""
    folder = tiny_folder("hunyuanvideo-1.5-i2v")
    pipeline = Pipeline.load(folder, devices="cpu")
    frame = source_image(128).resize((128, 64))
    asked = GenerationRequest("a red circle", "blurry", seed=3, steps=3, frames=5, reference=frame)
    request = pipeline.resolve(asked)
    assert (request.width, request.height) == (80, 48) and request.reference.size == (80, 48)
    mine, theirs = pipeline.generate([request])[0], hunyuan_video(folder, request, frame)
    assert mine.shape == theirs.shape == (5, 48, 80, 3)
    assert alike(mine, theirs) * 255 <= 2
    with pytest.raises(InvalidRequest) as refused:
        pipeline.resolve(GenerationRequest("a red circle", frames=5))
    assert refused.value.field == "input_reference"


def test_a_vae_decode_that_cannot_compile_stays_eager_and_says_why(pipeline, caplog) -> None:
    """Its VAE branches on its data (dynamo refuses to trace it): the decoder's compile gives up
    with a warning naming the VAE, decodes eagerly as before, and raises nothing (it failed the
    whole background compile, the denoiser's graphs with it)."""
    from server.engine.runtime.compile import CompiledDecoder
    from server.engine.runtime.graphs import CompileStats, GraphStore

    vae = pipeline.vae
    latents = torch.randn(1, vae.config.latent_channels, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    decoder = CompiledDecoder(vae, GraphStore(None, ["cpu"], CompileStats("blocks")))
    with caplog.at_level("WARNING", logger="diffshard"), torch.inference_mode():
        assert decoder.warm(latents) is None
        assert decoder.eager_only and "cannot compile AutoencoderKLHunyuanVideo15's decode" in caplog.text
        assert decoder.warm(latents) is None  # tried once
        assert torch.equal(decoder(latents), vae.decode(latents, return_dict=False)[0])
