"""A request resolved against its model: the folder's defaults filled in, then the model
invariants every request must meet.

These checks are what the model can run at all (sizes its VAE and denoiser take, schedulers its
family supports); the service's policy limits (max steps, pixels, ...) are applied before them,
to the request with its defaults filled in (`server/serving/limits.py`). Both raise
`InvalidRequest(field, message)`.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from server.errors import InvalidRequest
from server.pipeline.families import Family
from server.pipeline.families.base import edit_size
from server.requests.clip import check_frames
from server.requests.edit import Edit
from server.requests.generation import MAX_MODEL_STEPS, SEED_LIMIT, Defaults, GenerationRequest


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
        edit_crop=family.edit_crop,
        size_multiple=family.size_multiple,
        clip=family.clip,
        video_size=video_size,
    )


def resolve(request: GenerationRequest, defaults: Defaults, family: Family) -> GenerationRequest:
    """`request` with every unset field filled in from `defaults`, checked against the model. A
    first frame without a size sizes the video where the family's pipeline sizes it by the image
    (`reference_size`), and is fitted to the video's size as that pipeline fits it."""
    unsized = request.reference is not None and request.width is None and request.height is None
    if unsized and (size := family.reference_size(request.reference)) is not None:
        request = replace(request, width=size[0], height=size[1])
    request = with_defaults(request, defaults)
    _check(request, family)
    if request.reference is not None:
        fitted = family.fit_reference(request.reference, request.width, request.height)
        request = replace(request, reference=fitted)
    return request


def with_defaults(request: GenerationRequest, defaults: Defaults) -> GenerationRequest:
    """`request` with every unset field filled in from `defaults`; nothing checked."""
    d = defaults
    width, height = d.size, d.size
    if request.frames is not None and d.video_size is not None:
        width, height = d.video_size
    crop = request.crop
    if request.edit is not None:  # an edit's size is its image's, as diffusers' edit pipelines
        sized = d.edit_size or (lambda edit: edit_size(edit.image.size, d.size_multiple, None))
        width, height = sized(request.edit)
        if request.width is None and request.height is None and d.edit_crop is not None:
            crop = d.edit_crop(request.edit)  # the output cropped back from the size it was made at
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
        crop=crop,
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
        instead = "set true_cfg_scale with a negative_prompt" if family.takes_true_cfg else "leave it unset"
        raise InvalidRequest("guidance_scale", f"this model has no guidance input: {instead}")
    if request.true_cfg_scale != family.default_true_cfg and not family.takes_true_cfg:
        raise InvalidRequest(
            "true_cfg_scale", "is for models guided by true CFG (FLUX.1, Qwen-Image): set guidance_scale"
        )
    if not (math.isfinite(request.true_cfg_scale) and request.true_cfg_scale >= 0):
        raise InvalidRequest("true_cfg_scale", f"must be a finite number ≥ 0, got {request.true_cfg_scale}")
    if request.guidance is not None and not family.sound_parts:
        raise InvalidRequest("guidance", "is for a model that makes sound (LTX-2): set guidance_scale")
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
