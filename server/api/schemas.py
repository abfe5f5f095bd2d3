"""Request and response bodies of the Images API, and the checks against the configured limits.

The body follows OpenAI's `POST /v1/images/generations`; diffshard's extensions
(negative_prompt, num_inference_steps, guidance_scale, seed, scheduler) sit beside the
standard fields, where the SDKs put `extra_body`. Types are checked strictly ("2" is not
an integer); fields this service does not know (quality, style, ...) are ignored.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.errors import APIError
from server.config import Settings
from server.pipeline.denoise import Defaults, GenerationRequest
from server.pipeline.schedulers import SCHEDULER_NAMES

SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes any int below this
MAX_GUIDANCE = 100.0


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: str
    n: int = 1
    size: str | None = Field(None, description='"WIDTHxHEIGHT", multiples of 8; default: the native size')
    response_format: str = "b64_json"
    output_format: str = "png"
    model: str | None = None
    user: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = Field(None, description="image i uses seed + i; default: random")
    scheduler: str | None = Field(None, description=f"one of {', '.join(SCHEDULER_NAMES)}")


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str
    seed: int


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    size: str
    output_format: Literal["png"] = "png"


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _limit(name: str) -> str:
    return f"DIFFSHARD_{name.upper()}"


def parse_size(size: str, max_pixels: int) -> tuple[int, int]:
    match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size)
    if not match:
        raise _bad("size", f"must be WIDTHxHEIGHT in pixels, e.g. 512x512, got {size!r}")
    width, height = int(match[1]), int(match[2])
    if width <= 0 or height <= 0 or width % 8 or height % 8:
        raise _bad("size", f"width and height must be positive multiples of 8, got {size}")
    if width * height > max_pixels:
        raise _bad(
            "size",
            f"{size} is {width * height} pixels; the limit is {max_pixels} ({_limit('max_pixels')})",
        )
    return width, height


def generation_requests(
    body: ImageGenerationRequest, settings: Settings, defaults: Defaults, served_name: str
) -> tuple[list[GenerationRequest], str]:
    """One pipeline request per image, and the size they share; APIError (400) names what is wrong."""
    for param in ("prompt", "negative_prompt"):
        text = getattr(body, param)
        if param == "prompt" and not (text or "").strip():
            raise _bad("prompt", "must not be empty")
        if text is not None and len(text) > settings.max_prompt_chars:
            raise _bad(
                param,
                f"is {len(text)} characters; the limit is {settings.max_prompt_chars} "
                f"({_limit('max_prompt_chars')})",
            )
    if not 1 <= body.n <= settings.max_n:
        raise _bad("n", f"must be between 1 and {settings.max_n} ({_limit('max_n')}), got {body.n}")
    if body.response_format != "b64_json":
        raise _bad("response_format", f"only b64_json is served, got {body.response_format!r}")
    if body.output_format != "png":
        raise _bad("output_format", f"only png is served, got {body.output_format!r}")
    if body.model is not None and body.model != served_name:
        raise _bad("model", f"this server serves {served_name!r}, not {body.model!r}")
    native = (defaults.size, defaults.size)
    width, height = parse_size(body.size, settings.max_pixels) if body.size is not None else native
    steps = body.num_inference_steps
    if steps is not None and not 1 <= steps <= settings.max_steps:
        raise _bad(
            "num_inference_steps",
            f"must be between 1 and {settings.max_steps} ({_limit('max_steps')}), got {steps}",
        )
    guidance = body.guidance_scale
    if guidance is not None and not (math.isfinite(guidance) and 0 <= guidance <= MAX_GUIDANCE):
        raise _bad("guidance_scale", f"must be between 0 and {MAX_GUIDANCE:g}, got {guidance}")
    if body.seed is not None and not 0 <= body.seed < SEED_LIMIT:
        raise _bad("seed", f"must be between 0 and {SEED_LIMIT - 1}, got {body.seed}")
    if body.scheduler is not None and body.scheduler not in SCHEDULER_NAMES:
        raise _bad("scheduler", f"must be one of {', '.join(SCHEDULER_NAMES)}, got {body.scheduler!r}")
    seed = secrets.randbelow(SEED_LIMIT) if body.seed is None else body.seed
    requests = [
        GenerationRequest(
            prompt=body.prompt,
            negative_prompt=body.negative_prompt,
            seed=(seed + i) % SEED_LIMIT,
            steps=steps,
            guidance_scale=guidance,
            scheduler=body.scheduler,
            width=width,
            height=height,
        )
        for i in range(body.n)
    ]
    return requests, f"{width}x{height}"
