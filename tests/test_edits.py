"""Image edits (issue 24) in process on the tiny SD-1.5-, SDXL- and SD3-shaped folders: img2img
and inpainting through our pipeline give diffusers' `StableDiffusion(XL|3)Img2ImgPipeline` /
`...InpaintPipeline` image for the same image, mask, strength, seed and scheduler; an edit that
joins generations mid-way gives the image it gives alone. An inpainting keeps the unmasked pixels
(issue 36): outside the mask the source image, inside diffusers' image composited with its
`VaeImageProcessor.apply_overlay`, as its pipelines' `padding_mask_crop` path does, in uint8."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
)
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from server.errors import InvalidRequest
from server.media.images import to_uint8
from server.pipeline import Pipeline
from server.pipeline.steps.schedulers import make_scheduler
from server.requests import Edit, GenerationRequest
from tests.support.images import left_half_mask, source_image
from tests.support.tiny_pipelines import IMAGE_SIZE, build_sd15_inpainting_folder

TOLERANCE = 1e-3
PIXEL_TOLERANCE = 2  # of 255, in the PNG's pixels
REFERENCE = {
    ("sd15", "img2img"): StableDiffusionImg2ImgPipeline,
    ("sd15", "inpaint"): StableDiffusionInpaintPipeline,
    ("sdxl", "img2img"): StableDiffusionXLImg2ImgPipeline,
    ("sdxl", "inpaint"): StableDiffusionXLInpaintPipeline,
    ("sd3", "img2img"): StableDiffusion3Img2ImgPipeline,
    ("sd3", "inpaint"): StableDiffusion3InpaintPipeline,
}
NO_T5 = {"sd3": {"text_encoder_3": None, "tokenizer_3": None}}


def edit_request(
    mask: bool, strength: float, seed: int = 4, scheduler: str | None = None, keep: bool = False
) -> GenerationRequest:
    """keep=False: the model's whole image, diffusers' pipeline output without `padding_mask_crop`."""
    edit = Edit(source_image(), left_half_mask() if mask else None, strength, keep_unmasked=keep)
    return GenerationRequest(
        "a red circle",
        negative_prompt="blue",
        seed=seed,
        steps=6,
        guidance_scale=4.0,
        scheduler=scheduler,
        edit=edit,
    )


def theirs(folder: Path, kind: str, request: GenerationRequest) -> np.ndarray:
    mode = "inpaint" if request.edit.mask is not None else "img2img"
    pipe = REFERENCE[kind, mode].from_pretrained(folder, local_files_only=True, **NO_T5.get(kind, {}))
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler(pipe.scheduler, request.scheduler or "default")
    masked = {"mask_image": request.edit.mask} if mode == "inpaint" else {}
    # diffusers' SD3 inpainting decodes without the VAE's shift_factor, unlike its own encoding and
    # every other SD3 pipeline (diffusers#13611, issue 1; fix in PR #14671): compare its latents,
    # decoded as StableDiffusion3Img2ImgPipeline decodes
    unshifted = (kind, mode) == ("sd3", "inpaint")
    images = pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        image=request.edit.image,
        strength=request.edit.strength,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        height=request.height,
        width=request.width,
        output_type="latent" if unshifted else "np",
        **masked,
    ).images
    if unshifted:
        latents = images / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        with torch.no_grad():
            images = pipe.image_processor.postprocess(pipe.vae.decode(latents)[0], output_type="np")
    return images[0]


def kept(request: GenerationRequest) -> GenerationRequest:
    return replace(request, edit=replace(request.edit, keep_unmasked=True))


def overlaid(request: GenerationRequest, inpainted: np.ndarray | Image.Image) -> np.ndarray:
    """diffusers' composite: `apply_overlay(mask_image, original_image, image)`, as its inpainting
    pipelines call it after decoding with `padding_mask_crop` (uint8 pixels)."""
    processor = VaeImageProcessor()
    if isinstance(inpainted, np.ndarray):
        inpainted = processor.numpy_to_pil(inpainted[None])[0]
    return np.asarray(processor.apply_overlay(request.edit.mask, request.edit.image, inpainted)).astype(int)


def assert_keeps_unmasked_pixels(mine: np.ndarray, request: GenerationRequest, reference: np.ndarray) -> None:
    """Outside the mask the source's pixels, inside diffusers' composited `reference`, within 2/255."""
    pixels, unmasked = to_uint8(mine).astype(int), np.asarray(request.edit.mask) == 0
    source = np.asarray(request.edit.image).astype(int)
    assert np.abs(pixels - source)[unmasked].max() <= PIXEL_TOLERANCE
    assert np.abs(pixels - reference)[~unmasked].max() <= PIXEL_TOLERANCE


@pytest.fixture(scope="module")
def all_folders(folders: dict[str, Path], sd3_folder: Path) -> dict[str, Path]:
    return {**folders, "sd3": sd3_folder}


@pytest.mark.parametrize("kind", ["sd15", "sdxl", "sd3"])
@pytest.mark.parametrize(
    ("mask", "strength"),
    [(False, 0.6), (True, 0.75), (True, 1.0)],
    ids=["img2img", "inpaint", "inpaint-full"],
)
def test_edits_give_diffusers_image(all_folders, kind: str, mask: bool, strength: float) -> None:
    """With a mask, the same request keeping its unmasked pixels (the default) runs beside it."""
    pipeline = Pipeline.load(all_folders[kind], devices="cpu,cpu", strategy="even")
    request = pipeline.resolve(edit_request(mask, strength))
    mine, *keeping = pipeline.generate([request, kept(request)] if mask else [request])
    reference = theirs(all_folders[kind], kind, request)
    assert mine.shape == reference.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
    assert float(np.abs(mine - reference).max()) < TOLERANCE
    if mask:
        assert_keeps_unmasked_pixels(keeping[0], request, overlaid(request, reference))


@pytest.mark.parametrize("scheduler", ["euler_a", "dpmpp_2m"])
def test_edits_match_diffusers_with_schedulers_that_draw_noise_or_keep_history(
    folders, scheduler: str
) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    for mask in (False, True):
        request = pipeline.resolve(edit_request(mask, 0.7, scheduler=scheduler))
        mine = pipeline.generate([request])[0]
        assert float(np.abs(mine - theirs(folders["sd15"], "sd15", request)).max()) < TOLERANCE


def run_joining(pipeline: Pipeline, first: list[GenerationRequest], later: GenerationRequest, after: int):
    """`first` stepped `after` times, then `later` joins: every step one call with all rows."""
    states = pipeline.start([pipeline.resolve(r) for r in first])
    rows_per_call: list[int] = []
    try:
        for _ in range(after):
            pipeline.step(states)
        states += pipeline.start([pipeline.resolve(later)])
        while active := [s for s in states if not s.done]:
            rows_per_call.append(sum(s.rows for s in active))
            pipeline.step(active)
        images = [pipeline.decode([s])[0].numpy().copy() for s in states]
    finally:
        for state in states:
            state.close()
    return images, rows_per_call


@pytest.mark.parametrize("kind", ["sd15", "sd3"])
def test_an_edit_joining_generations_mid_way_gives_its_image_alone(all_folders, kind: str) -> None:
    pipeline = Pipeline.load(all_folders[kind], devices="cpu")
    generations = [
        GenerationRequest("a blue square", seed=1, steps=6, guidance_scale=4.0),
        GenerationRequest("a red circle", seed=2, steps=6, guidance_scale=4.0),
    ]
    edit = edit_request(mask=True, strength=0.75)
    together, rows_per_call = run_joining(pipeline, generations, edit, after=2)
    assert rows_per_call[0] == 6  # the edit's two rows shared a call with both generations' four
    alone = [pipeline.generate([r])[0] for r in [*generations, edit]]
    for one, joined in zip(alone, together, strict=True):
        assert float(np.abs(one - joined).max()) < TOLERANCE


def test_edits_out_of_bounds_are_refused_naming_the_field(folders) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    image = source_image()
    cases = {
        "strength": [Edit(image, None, 0.0), Edit(image, None, 1.5), Edit(image, None, float("nan"))],
        "mask": [Edit(image, left_half_mask(16)), Edit(image, Image.new("L", image.size, 0))],
    }
    for field, edits in cases.items():
        for edit in edits:
            with pytest.raises(InvalidRequest) as refused:
                pipeline.resolve(GenerationRequest("a red circle", steps=6, edit=edit))
            assert refused.value.field == field
    with pytest.raises(InvalidRequest, match="runs no step") as refused:  # 0.1 × 6 steps: none
        pipeline.resolve(GenerationRequest("a red circle", steps=6, edit=Edit(image, None, 0.1)))
    assert refused.value.field == "strength"
    # an edit's default size is its image's, rounded down to what the model takes
    odd = Edit(source_image(37))
    assert pipeline.resolve(GenerationRequest("a red circle", edit=odd)).width == 32


@pytest.fixture(scope="module")
def inpainting_folder(tmp_path_factory) -> Path:
    return build_sd15_inpainting_folder(tmp_path_factory.mktemp("sd15-inpainting"))


@pytest.mark.parametrize(
    ("strength", "scheduler"), [(0.75, None), (1.0, None), (0.7, "euler_a")], ids=["0.75", "1.0", "euler_a"]
)
def test_an_inpainting_unet_takes_the_mask_and_masked_image_as_diffusers_gives_them(
    inpainting_folder: Path, strength: float, scheduler: str | None
) -> None:
    pipeline = Pipeline.load(inpainting_folder, devices="cpu,cpu", strategy="even")
    assert pipeline.family.inpainting_channels == 5
    request = pipeline.resolve(edit_request(True, strength, scheduler=scheduler))
    mine, keeping = pipeline.generate([request, kept(request)])
    reference = theirs(inpainting_folder, "sd15", request)
    assert float(np.abs(mine - reference).max()) < TOLERANCE
    assert_keeps_unmasked_pixels(keeping, request, overlaid(request, reference))


def test_an_inpainting_unet_repaints_everything_without_a_mask_and_generates_from_black(
    inpainting_folder: Path,
) -> None:
    """Without a mask the whole image is repainted (diffusers: a white mask); a generation is an
    inpainting of a black image, everything repainted at strength 1."""
    pipeline = Pipeline.load(inpainting_folder, devices="cpu")
    white = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 255)
    restyle = pipeline.resolve(edit_request(False, 0.75))
    as_inpainting = replace(restyle, edit=Edit(restyle.edit.image, white, 0.75))
    generation = pipeline.resolve(GenerationRequest("a red circle", seed=2, steps=6, guidance_scale=4.0))
    from_black = replace(generation, edit=Edit(Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE)), white, 1.0))
    mine = pipeline.generate([restyle, generation])  # stepped together
    for image, reference in zip(mine, (as_inpainting, from_black), strict=True):
        assert float(np.abs(image - theirs(inpainting_folder, "sd15", reference)).max()) < TOLERANCE


def test_inpainting_keeps_the_unmasked_pixels_by_default_as_diffusers_padding_mask_crop_does(folders) -> None:
    """The default Edit: diffusers' own `padding_mask_crop` path, its crop the whole image (so it
    runs on the same image and mask), gives the same pixels. An image of another size than the
    output is kept resized, as the model saw it."""
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    request = pipeline.resolve(
        replace(edit_request(True, 0.75), edit=Edit(source_image(), left_half_mask(), 0.75))
    )
    odd = Edit(source_image(IMAGE_SIZE + 4), left_half_mask(IMAGE_SIZE + 4))
    resized = pipeline.resolve(GenerationRequest("a red circle", seed=1, steps=6, edit=odd))
    mine, mine_resized = pipeline.generate([request, resized])
    pipe = StableDiffusionInpaintPipeline.from_pretrained(folders["sd15"], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler(pipe.scheduler, request.scheduler or "default")
    theirs_cropped = pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        image=request.edit.image,
        mask_image=request.edit.mask,
        strength=request.edit.strength,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        padding_mask_crop=IMAGE_SIZE,  # the mask's box grown by the image's size: all of it
    ).images[0]
    assert_keeps_unmasked_pixels(mine, request, np.asarray(theirs_cropped).astype(int))
    size = (IMAGE_SIZE, IMAGE_SIZE)  # the odd image and mask, resized as the model saw them
    source = np.asarray(odd.image.resize(size, Image.LANCZOS)).astype(int)
    unmasked = np.asarray(odd.mask.resize(size, Image.LANCZOS)) == 0
    assert mine_resized.shape == (*size, 3) and unmasked.mean() > 0.4
    assert np.abs(to_uint8(mine_resized).astype(int) - source)[unmasked].max() <= PIXEL_TOLERANCE
