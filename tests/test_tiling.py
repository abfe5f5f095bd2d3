"""Tiled VAE decoding and encoding (`--vae-tiling`): a 1024² request on a tiny SD-1.5 folder gives
diffusers' image with `vae.enable_tiling()` when tiled and without it when whole; an edit's image
encodes in tiles as diffusers' img2img does; the compiled decoder leaves tiles to eager code; the
decoder's peak as counted from its config against the one torch's CPU allocator records; `plan`
prints both peaks, and a bad value names the setting."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, StableDiffusionImg2ImgPipeline, StableDiffusionPipeline
from PIL import Image, ImageDraw
from torch.profiler import ProfilerActivity, profile

from server.__main__ import main
from server.engine.runtime.compile import CompiledDecoder, run_decoder
from server.engine.runtime.graphs import CompileStats, GraphStore
from server.pipeline import Pipeline
from server.pipeline.loading.folder import read_family
from server.pipeline.loading.vae_tiling import VaeShape, VaeTiling, decoder_memory, decoder_peak, set_tiling
from server.requests import Edit, GenerationRequest
from server.serving.limits import check_limits
from server.settings import Settings
from server.startup import decoder_for, plan_for, request_limits
from tests.support.tiny_pipelines import IMAGE_SIZE, LARGE_SD15, _vae, build_sd15_folder, diffusers_image

PIXEL = 2 / 255
LARGE = 1024 * 1024


@pytest.fixture(scope="module")
def large_sd15(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sd15_folder(tmp_path_factory.mktemp("tiny") / "sd15-large", **LARGE_SD15)


def test_a_1024_request_in_tiles_equals_diffusers_with_enable_tiling_and_whole_without(
    large_sd15: Path,
) -> None:
    request = GenerationRequest(
        "a red circle", negative_prompt="blue", seed=3, steps=2, guidance_scale=4.0, width=1024, height=1024
    )
    pipe = StableDiffusionPipeline.from_pretrained(large_sd15, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    family = read_family(large_sd15)
    images = {}
    for tiling in ("on", "off"):
        settings = Settings(model=large_sd15, devices="cpu", max_pixels=LARGE, vae_tiling=tiling)
        plan = plan_for(settings, family, folder=large_sd15)
        pipeline = Pipeline.load(large_sd15, plan=plan, vae_tiling=decoder_for(settings, family, plan).tiling)
        resolved = pipeline.resolve(request)
        check_limits(
            [resolved], request_limits(settings, family), family.rows
        )  # 1024² within the raised limit
        ours = images[tiling] = pipeline.generate([request])[0]
        set_tiling(pipe.vae, tiling == "on")
        theirs = diffusers_image(pipe, resolved)
        assert ours.shape == theirs.shape == (1024, 1024, 3)
        assert np.abs(ours - theirs).max() <= PIXEL, tiling
    assert ((images["on"] > 0.01) & (images["on"] < 0.99)).mean() > 0.5, "a saturated image hides seams"
    assert np.abs(images["on"] - images["off"]).max() > 2 * PIXEL  # the tiles are there to see


def test_an_edit_encodes_its_image_in_tiles_as_diffusers_img2img(folders: dict[str, Path]) -> None:
    """64² is twice the tiny VAE's 32-pixel tile: the image encodes, and the result decodes, in tiles."""
    size = 2 * IMAGE_SIZE
    image = Image.new("RGB", (size, size), (20, 20, 30))
    ImageDraw.Draw(image).ellipse((4, 12, size - 4, size - 12), fill=(220, 30, 30))
    request = GenerationRequest(
        "a red circle", seed=4, steps=4, guidance_scale=4.0, edit=Edit(image, strength=0.6)
    )
    pipeline = Pipeline.load(folders["sd15"], devices="cpu", vae_tiling=True)
    ours = pipeline.generate([request])[0]
    pipe = StableDiffusionImg2ImgPipeline.from_pretrained(folders["sd15"], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling()
    theirs = pipe(
        prompt=request.prompt,
        image=image,
        strength=0.6,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        output_type="np",
    ).images[0]
    assert ours.shape == theirs.shape == (size, size, 3)
    assert np.abs(ours - theirs).max() <= PIXEL


def test_the_compiled_decoder_leaves_tiled_latents_to_diffusers_eager_tiles() -> None:
    vae = set_tiling(_vae().eval(), True)
    stats = CompileStats("full")
    decoder = CompiledDecoder(vae, GraphStore(None, ["cpu"], stats))
    latents = torch.randn(1, 4, 2 * vae.tile_latent_min_size, 2 * vae.tile_latent_min_size)
    decoder.warm(latents)  # larger than a tile: nothing to trace
    assert stats.graphs_ready == 0
    with torch.inference_mode():
        assert torch.equal(decoder(latents), vae.tiled_decode(latents, return_dict=False)[0])
        assert torch.equal(decoder(latents), run_decoder(vae, latents))


def measured_peak(vae: AutoencoderKL, latents: torch.Tensor) -> int:
    """The decode's peak bytes as torch's CPU allocator reports them to the profiler: its
    allocations and frees in time order, summed, at their highest (the latents, allocated before,
    added). A first call measures as a later one: nothing is cached."""
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        vae.decode(latents)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak + latents.numel() * latents.element_size()


def test_a_video_vaes_peak_counted_on_meta_is_within_15_percent_of_the_cpu_allocators() -> None:
    """Wan 2.1's VAE at its published widths (random weights), 3 latent frames (9 frames) of
    64²: the meta count (server/engine/planning/live.py) against the CPU allocator. The count
    leaves out oneDNN's own copies: measured 0.91 of the allocator here."""
    from diffusers import AutoencoderKLWan

    from server.pipeline.families.wan import WAN_VAE
    from server.pipeline.loading.vae_tiling import video_decoder_peak

    torch.manual_seed(0)
    vae = AutoencoderKLWan.from_config(WAN_VAE).eval()
    measured = measured_peak(vae, torch.randn(1, 16, 3, 8, 8))
    counted = video_decoder_peak(WAN_VAE, 64, 3, torch.float32)
    print(f"Wan VAE, 9 frames of 64²: counted {counted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert 0.85 * measured <= counted <= measured


def test_the_counted_peak_is_what_the_cpu_allocator_holds() -> None:
    """Counted: the tensors diffusers' forwards name, alive at once. Two images a call: the bytes
    torch's CPU allocator held, whole and tiled. One image: oneDNN also reorders a convolution's
    input and output (a copy of each), and the allocator holds up to a third more."""
    torch.manual_seed(0)
    vae = _vae(**LARGE_SD15["vae"]).eval()
    counted = VaeShape.of(vae.config, default_tile=0)
    side = 640  # 80² latents: 2 x 2 tiles of at most 64²
    for images, low, high in ((2, 0.99, 1.01), (1, 0.99, 1.35)):
        latents = torch.randn(images, 4, side // counted.factor, side // counted.factor)
        for tiled in (False, True):
            set_tiling(vae, tiled)
            predicted = decoder_peak(counted, side, side, images, 4, tiled=tiled)
            ratio = measured_peak(vae, latents) / predicted
            assert low <= ratio <= high, (images, tiled, ratio)


def test_auto_tiles_where_an_image_decoded_whole_is_over_a_budgeted_activation_reserve() -> None:
    config = dict(_vae(**LARGE_SD15["vae"]).config)
    fit = {"side": 1024, "default_tile": 0, "dtype": torch.float32}
    whole = decoder_memory(config, **fit, setting=VaeTiling.OFF, reserve=0).untiled_bytes
    assert decoder_memory(config, **fit, setting=VaeTiling.AUTO, reserve=whole - 1).tiling
    assert not decoder_memory(config, **fit, setting=VaeTiling.AUTO, reserve=whole).tiling
    assert decoder_memory(config, **fit, setting=VaeTiling.ON, reserve=whole).tiling
    assert not decoder_memory(config, **fit, setting=VaeTiling.OFF, reserve=0).tiling
    assert not decoder_memory(config, **fit, setting=VaeTiling.AUTO, reserve=None).tiling  # no budget


def test_plan_prints_the_decoders_peak_with_and_without_tiles(
    large_sd15: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", "--model", str(large_sd15), "--devices", "cpu", "--max-pixels", str(LARGE)]
    assert main([*args, "--json"]) == 0
    decoder = json.loads(capsys.readouterr().out)["vae_decoder"]
    counted = VaeShape.of(read_family(large_sd15).config.vae, default_tile=0)
    assert decoder["side"] == 1024 and decoder["tile"] == 512 and decoder["setting"] == "auto"
    assert decoder["untiled_bytes"] == decoder_peak(counted, 1024, 1024, tiled=False)
    assert decoder["tiled_bytes"] == decoder_peak(counted, 1024, 1024, tiled=True) < decoder["untiled_bytes"]
    assert decoder["reserve_bytes"] is None and not decoder["tiling"]  # no budget on cpu: auto keeps it whole
    assert main([*args, "--max-memory", "cpu=8GiB", "--max-batch", "1"]) == 0  # a small reserve: auto tiles
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("VAE decoder at 1024²: peak 192.5 MiB an image whole, 58.8 MiB in 512² tiles")
    assert "--vae-tiling auto: tiles (an image's whole peak is over the" in line


def test_a_bad_vae_tiling_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--vae-tiling", "sometimes"]) == 2
    expected = "error: --vae-tiling (DIFFSHARD_VAE_TILING): write auto, on or off, got 'sometimes'"
    assert capsys.readouterr().err.strip() == expected
    monkeypatch.setenv("DIFFSHARD_VAE_TILING", "tiles")
    assert main(["plan"]) == 2
    assert (
        "--vae-tiling (DIFFSHARD_VAE_TILING): write auto, on or off, got 'tiles'" in capsys.readouterr().err
    )


def test_a_long_clips_decode_peak_is_extrapolated_from_two_counts_within_2_percent() -> None:
    """Past COUNTED_LATENT_FRAMES the peak is extrapolated (a meta run of a plan's longest clip,
    hundreds of latent frames, would take minutes): against a count of 40 latent frames."""
    from server.pipeline.families.wan import WAN_VAE
    from server.pipeline.loading.vae_tiling import _VIDEO_PEAKS, COUNTED_LATENT_FRAMES, video_decoder_peak

    extrapolated = video_decoder_peak(WAN_VAE, 64, 40, torch.float32)
    assert COUNTED_LATENT_FRAMES < 40 and not any(key[2] == 40 for key in _VIDEO_PEAKS)  # not run
    with patch("server.pipeline.loading.vae_tiling.COUNTED_LATENT_FRAMES", 40):
        counted = video_decoder_peak(WAN_VAE, 64, 40, torch.float32)
    assert abs(extrapolated - counted) <= 0.02 * counted, (extrapolated, counted)


def test_a_video_models_decoder_is_counted_at_the_longest_clip_it_admits(tiny_folder) -> None:
    """`max_clip` admits --max-batch default clips' latent frames at the largest size: the VAE's
    peak is counted there (before: at the 81-frame default, and the longest clips ran out of
    memory after all their steps)."""
    folder = tiny_folder("wan2.1")
    family = read_family(folder)
    settings = Settings(model=folder, max_batch=4)
    # 4 rows of the 81-frame clip's 21 latent frames, within what the tiny transformer takes
    assert family.clip is not None
    assert family.clip.longest(4) == min((4 * 21 - 1) * 4 + 1, family.clip.max_frames) == 125
    plan = plan_for(settings, family, folder=folder)
    assert decoder_for(settings, family, plan).frames == 125
