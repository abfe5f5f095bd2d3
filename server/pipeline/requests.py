"""One image to generate, its defaults, and the model invariants every request must meet.

These checks are what the model can run at all (sizes its VAE and denoiser take, schedulers its
family supports); the service's policy limits (max steps, pixels, ...) are applied before them,
to the request with its defaults filled in (`server/serving/limits.py`). Both raise
`InvalidRequest(field, message)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from PIL import Image

from server.errors import InvalidRequest
from server.pipeline.clips import Clip, check_frames
from server.pipeline.controls import Control
from server.pipeline.edits import Edit
from server.pipeline.families import Family
from server.pipeline.families.base import edit_size
from server.pipeline.stepcache import OFF, StepCache

SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes any int below this
MAX_MODEL_STEPS = 1000  # diffusers' schedulers train on 1000 timesteps
KINDS = ("generation", "img2img", "inpainting")


@dataclass(frozen=True)
class GenerationRequest:
    """One image. Unset fields take the pipeline's defaults (`Pipeline.defaults`)."""

    prompt: str
    negative_prompt: str | None = None
    seed: int = 0
    steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = (
        None  # two experts (Wan 2.2 A14B): the low-noise one's; None: guidance_scale
    )
    scheduler: str | None = None
    width: int | None = None
    height: int | None = None
    partial_images: int = 0  # previews of the predicted clean image, at evenly spaced steps
    deterministic: bool = False  # its calls run alone: its bytes do not depend on the batch
    lora: tuple[tuple[str, float], ...] = ()  # adapters and their scales (lora.py), in order
    edit: Edit | None = None  # the image an edit starts from (edits.py); None: text to image
    true_cfg_scale: float | None = None  # true CFG (FLUX.1, Qwen-Image): with negative_prompt when > 1
    step_cache: StepCache | None = None  # reuse of the last steps' features (stepcache.py)
    frames: int | None = None  # a video's frames (video families only); None: an image
    latent_frames: int = 1  # what a video weighs in work: its latent frames (set with the defaults)
    control: tuple[Control, ...] = ()  # ControlNets steering its rows (controls.py), summed
    # image-to-video's first frame (RGB, resized to the video's size); compared by the others' fields
    reference: Image.Image | None = field(default=None, compare=False)

    @property
    def kind(self) -> str:
        """generation, img2img or inpainting: one of KINDS (a bounded metric label)."""
        if self.edit is None:
            return "generation"
        return "img2img" if self.edit.mask is None else "inpainting"

    @property
    def resolved(self) -> bool:
        fields = (self.steps, self.guidance_scale, self.scheduler, self.width, self.height, self.step_cache)
        return None not in fields


@dataclass(frozen=True)
class Defaults:
    steps: int
    guidance_scale: float
    scheduler: str
    size: int  # native image side in pixels
    size_multiple: int = 8  # an edit's default size: its image's, rounded down to this
    step_cache: StepCache = OFF  # --step-cache
    clip: Clip | None = None  # a video family's (clips.py): its default frames and frames' rule
    video_size: tuple[int, int] | None = None  # (width, height) of a video that names none; None: size²
    true_cfg_scale: float = 1.0  # the family's (QwenImagePipeline's 4.0): on with a negative prompt
    edit_size: Callable[[Edit], tuple[int, int]] | None = None  # an edit's default size (its family's)


# Past this share of the native area (or under its inverse) a model draws what it never trained on:
# SD-1.5 at 768x768 (2.25x) repeats its subject; SD-1.5 at 768x512 (1.5x) is common practice.
TRAINED_AREA = 1.5


def size_warning(request: GenerationRequest, defaults: Defaults) -> str | None:
    """A word for the client when the request's size is far from the model's native one (where
    images often repeat or lose their subject); None at sizes near it. A video's native size is
    its model's default clip's (Wan: 832x480), where it has one."""
    assert request.width is not None and request.height is not None  # resolved
    width, height = defaults.size, defaults.size
    if request.frames is not None and defaults.video_size is not None:
        width, height = defaults.video_size
    area = request.width * request.height / (width * height)
    if 1 / TRAINED_AREA <= area <= TRAINED_AREA:
        return None
    return (
        f"{request.width}x{request.height} is {area:.3g}x the area this model was trained at "
        f"({width}x{height}): images may repeat or lose their subject; the native size works best"
    )


def read_defaults(folder: Path, family: Family) -> Defaults:
    """The folder's recommended settings (recommended.json, as the built-in model has), else the family's."""
    settings: dict = {}
    recommended = folder / "recommended.json"
    if recommended.is_file():
        settings = json.loads(recommended.read_text()).get("recommended", {})
    video_size, largest = family.clip and family.clip.size, family.max_size
    if video_size and largest and max(video_size) > largest:  # a tiny test model's short RoPE
        video_size = None
    return Defaults(
        steps=int(settings.get("num_inference_steps", family.default_steps)),
        guidance_scale=float(settings.get("guidance_scale", family.default_guidance)),
        scheduler="default",
        size=int(settings.get("size", family.native_size)),
        true_cfg_scale=float(settings.get("true_cfg_scale", family.default_true_cfg)),
        edit_size=family.edit_size,
        size_multiple=family.size_multiple,
        clip=family.clip,
        video_size=video_size,
    )


def resolve(request: GenerationRequest, defaults: Defaults, family: Family) -> GenerationRequest:
    """`request` with every unset field filled in from `defaults`, checked against the model."""
    request = with_defaults(request, defaults)
    _check(request, family)
    return request


def with_defaults(request: GenerationRequest, defaults: Defaults) -> GenerationRequest:
    """`request` with every unset field filled in from `defaults`; nothing checked."""
    d = defaults
    width, height = d.size, d.size
    if request.frames is not None and d.video_size is not None:
        width, height = d.video_size
    if request.edit is not None:  # an edit's size is its image's, as diffusers' edit pipelines
        sized = d.edit_size or (lambda edit: edit_size(edit.image.size, d.size_multiple, None))
        width, height = sized(request.edit)
    return replace(
        request,
        steps=d.steps if request.steps is None else request.steps,
        guidance_scale=d.guidance_scale if request.guidance_scale is None else request.guidance_scale,
        scheduler=request.scheduler or d.scheduler,
        true_cfg_scale=d.true_cfg_scale if request.true_cfg_scale is None else request.true_cfg_scale,
        width=width if request.width is None else request.width,
        height=height if request.height is None else request.height,
        step_cache=d.step_cache if request.step_cache is None else request.step_cache,
        latent_frames=1 if request.frames is None or d.clip is None else d.clip.latent(request.frames),
    )


def _check(request: GenerationRequest, family: Family) -> None:
    for name in ("prompt", "negative_prompt"):
        text = getattr(request, name)
        if text is not None and not _is_unicode(text):  # the tokenizer would raise on it mid-batch
            raise InvalidRequest(name, "must be valid Unicode text (it holds a lone surrogate)")
    if not request.prompt.strip():
        raise InvalidRequest("prompt", "must not be empty")
    if not 1 <= request.steps <= MAX_MODEL_STEPS:
        raise InvalidRequest("steps", f"must be between 1 and {MAX_MODEL_STEPS}, got {request.steps}")
    if not (math.isfinite(request.guidance_scale) and request.guidance_scale >= 0):
        raise InvalidRequest("guidance_scale", f"must be a finite number ≥ 0, got {request.guidance_scale}")
    second = request.guidance_scale_2
    if second is not None and not (math.isfinite(second) and second >= 0):
        raise InvalidRequest("guidance_scale_2", f"must be a finite number ≥ 0, got {second}")
    if request.guidance_scale != family.default_guidance and not family.takes_guidance:
        raise InvalidRequest(
            "guidance_scale", "this model has no guidance input: set true_cfg_scale with a negative_prompt"
        )
    if request.true_cfg_scale != family.default_true_cfg and not family.takes_true_cfg:
        raise InvalidRequest(
            "true_cfg_scale", "is for models guided by true CFG (FLUX.1, Qwen-Image): set guidance_scale"
        )
    if not (math.isfinite(request.true_cfg_scale) and request.true_cfg_scale >= 0):
        raise InvalidRequest("true_cfg_scale", f"must be a finite number ≥ 0, got {request.true_cfg_scale}")
    if request.scheduler not in family.schedulers:
        names = ", ".join(family.schedulers)
        raise InvalidRequest("scheduler", f"must be one of {names} for this model, got {request.scheduler!r}")
    multiple, largest = family.size_multiple, family.max_size
    size = f"{request.width}x{request.height}"
    if min(request.width, request.height) <= 0 or request.width % multiple or request.height % multiple:
        raise InvalidRequest("size", f"width and height must be positive multiples of {multiple}, got {size}")
    if largest is not None and max(request.width, request.height) > largest:
        raise InvalidRequest("size", f"width and height must be at most {largest} for this model, got {size}")
    if not 0 <= request.seed < SEED_LIMIT:
        raise InvalidRequest("seed", f"must be between 0 and {SEED_LIMIT - 1}, got {request.seed}")
    if request.step_cache.policy not in family.step_caches:
        served = ", ".join(family.step_caches)
        raise InvalidRequest(
            "step_cache", f"policy {request.step_cache.policy!r} does not fit this model; it takes {served}"
        )
    if request.frames is not None:
        _check_frames(request, family)
    if request.edit is not None and not family.edits_by_reference:  # those take no strength nor mask
        _check_edit(request, request.edit, family)
    if request.reference is not None or family.takes_reference:
        _check_reference(request, family)
    family.check_request(request)


def _check_reference(request: GenerationRequest, family: Family) -> None:
    if not (family.takes_reference or family.pastes_first_frame):
        raise InvalidRequest("input_reference", "this model makes video from text only: send a prompt alone")
    if request.reference is None:
        raise InvalidRequest(
            "input_reference", "this model makes video from an image: send input_reference, its first frame"
        )
    if request.edit is not None:
        raise InvalidRequest(
            "image", "this model makes video from a first frame (input_reference), not edits"
        )


def _check_frames(request: GenerationRequest, family: Family) -> None:
    check_frames(request.frames, family.clip)
    if request.partial_images or request.edit is not None:
        raise InvalidRequest(
            "partial_images" if request.partial_images else "image", "videos take neither yet"
        )


def _check_edit(request: GenerationRequest, edit: Edit, family: Family) -> None:
    strength = edit.strength
    if not (math.isfinite(strength) and 0 < strength <= 1):
        raise InvalidRequest("strength", f"must be greater than 0 and at most 1, got {strength}")
    if request.steps - family.edit_begin(request.steps, strength) < 1:
        raise InvalidRequest(
            "strength",
            f"{strength} of {request.steps} steps runs no step: raise strength or num_inference_steps",
        )
    if edit.mask is not None:
        if edit.mask.size != edit.image.size:
            given, wanted = "x".join(map(str, edit.mask.size)), "x".join(map(str, edit.image.size))
            raise InvalidRequest("mask", f"must have the image's size, {wanted}, got {given}")
        if edit.mask.getextrema()[1] == 0:
            raise InvalidRequest("mask", "has no transparent pixel: it marks nothing to repaint")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
