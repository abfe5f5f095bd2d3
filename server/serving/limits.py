"""The service's policy limits, applied to requests once the model's defaults are filled in (so a
limit binds the defaults as much as what a client sent) and before the model's own invariants
(`server/pipeline/resolve.py`) are checked. Each error names the field and the setting that
bounds it."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from server.errors import InvalidRequest
from server.pipeline.families import Family
from server.pipeline.loading.model_plan import largest_side
from server.requests import Defaults, GenerationRequest
from server.requests.clip import Clip

log = logging.getLogger("diffshard")


@dataclass(frozen=True)
class Limits:
    max_n: int = 10
    max_steps: int = 100
    max_pixels: int = 1024 * 1024
    max_prompt_chars: int = 2000
    max_work: float = 1000.0  # native-image steps: n x steps x pixels / native_pixels
    native_pixels: int = 512 * 512
    request_timeout_s: float = 300.0
    video_timeout_s: float = 3600.0  # a video job's deadline: minutes of work, not an image's
    max_image_bytes: int = 4 * 2**20  # one image (or mask) sent to edit
    max_image_pixels: int = 4 * 1024 * 1024  # its width x height, read from its header before decoding
    max_edit_images: int = 4
    # one video's rows x latent frames x pixels: what the plan's activation reserve holds a step
    # (--max-batch rows of the model's default clip at the largest size); a row is not split
    max_clip: float = math.inf
    clip: Clip | None = None  # the video family's (requests/clip.py): the clip the reserve is sized by

    def deadline(self, video: bool) -> tuple[float, str]:
        """A job's seconds from arrival, and the setting that sets them (said when it runs out)."""
        if video:
            return self.video_timeout_s, "DIFFSHARD_VIDEO_TIMEOUT_S"
        return self.request_timeout_s, "DIFFSHARD_REQUEST_TIMEOUT_S"


def check_limits(
    requests: Sequence[GenerationRequest], limits: Limits, rows: Callable[[GenerationRequest], int]
) -> None:
    """Raise InvalidRequest for the first limit a job of resolved `requests` breaks; `rows`: the
    denoiser rows a request takes (2 when guided)."""
    if not 1 <= len(requests) <= limits.max_n:
        raise InvalidRequest(
            "n", f"must be between 1 and {limits.max_n}, got {len(requests)}", "DIFFSHARD_MAX_N"
        )
    for r in requests:
        for name in ("prompt", "negative_prompt"):
            text = getattr(r, name)
            if text is not None and len(text) > limits.max_prompt_chars:
                message = f"is {len(text)} characters; the limit is {limits.max_prompt_chars}"
                raise InvalidRequest(name, message, "DIFFSHARD_MAX_PROMPT_CHARS")
        if not 1 <= r.steps <= limits.max_steps:
            message = f"must be between 1 and {limits.max_steps}, got {r.steps}"
            raise InvalidRequest("steps", message, "DIFFSHARD_MAX_STEPS")
        if r.width * r.height > limits.max_pixels:
            message = f"{r.width}x{r.height} is {r.width * r.height} pixels; the limit is {limits.max_pixels}"
            raise InvalidRequest("size", message, "DIFFSHARD_MAX_PIXELS")
        if r.frames is not None and rows(r) * r.latent_frames * r.width * r.height > limits.max_clip:
            raise InvalidRequest("num_frames", _clip_message(r, rows(r), limits), "DIFFSHARD_MAX_BATCH")
    work = sum(r.steps * r.width * r.height * r.latent_frames for r in requests) / limits.native_pixels
    if work > limits.max_work:
        first, frames = requests[0], requests[0].latent_frames
        clip = f" x {frames} latent frames" if frames > 1 else ""
        message = (
            f"n x steps x pixels{' x latent frames' * (frames > 1)} is {work:g} native-image steps "
            f"({len(requests)} x {first.steps} x {first.width}x{first.height}{clip}); "
            f"the limit is {limits.max_work:g}"
        )
        raise InvalidRequest("num_frames" if frames > 1 else "n", message, "DIFFSHARD_MAX_WORK")


def _clip_message(request: GenerationRequest, rows: int, limits: Limits) -> str:
    """What a video too long for the reserve may be at its size, in frames."""
    assert limits.clip is not None  # only a video family has a finite max_clip
    latent = int(limits.max_clip // (rows * request.width * request.height))
    longest = f"at most {limits.clip.frames_of(latent)}" if latent else "no video"
    return (
        f"{request.frames} frames at {request.width}x{request.height} ({rows} rows) need more activation "
        f"memory a step than the plan keeps: {longest} frames at this size (the plan keeps --max-batch "
        f"rows of the {limits.clip.frames}-frame clip at the largest size)"
    )


def fit_defaults(defaults: Defaults, limits: Limits, family: Family) -> Defaults:
    """The model's defaults lowered to the limits, with a warning: a request that leaves a field
    unset must not be refused (or run) beyond what the operator allows."""
    fitted = defaults
    if defaults.steps > limits.max_steps:
        fitted = replace(fitted, steps=limits.max_steps)
    if defaults.size * defaults.size > limits.max_pixels:
        fitted = replace(fitted, size=largest_side(family, limits.max_pixels))
    if fitted != defaults:
        log.warning(
            "the model's defaults (%d steps, %dx%d) are beyond the limits: requests that leave them "
            "unset get %d steps at %dx%d (DIFFSHARD_MAX_STEPS, DIFFSHARD_MAX_PIXELS)",
            defaults.steps,
            defaults.size,
            defaults.size,
            fitted.steps,
            fitted.size,
            fitted.size,
        )
    if (clip := defaults.video_size) and clip[0] * clip[1] > limits.max_pixels:
        log.warning(
            "the model's default clip size (%dx%d) is beyond the limits: videos that leave it unset "
            "get %dx%d (DIFFSHARD_MAX_PIXELS)",
            *clip,
            fitted.size,
            fitted.size,
        )
        fitted = replace(fitted, video_size=None)
    return fitted
