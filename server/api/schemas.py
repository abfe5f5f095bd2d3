"""Request and response bodies of the Images API, and their translation into pipeline requests.

The body follows OpenAI's `POST /v1/images/generations`; diffshard's extensions
(negative_prompt, num_inference_steps, guidance_scale, seed, scheduler) sit beside the
standard fields, where the SDKs put `extra_body`. Types are checked strictly ("2" is not
an integer); fields this service does not know (quality, style, ...) are ignored. What the
wire format decides is checked here; the service's limits and the model's invariants are
checked by the serving layer when the job is submitted.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.errors import InvalidRequest
from server.pipeline import GenerationRequest
from server.pipeline.requests import SEED_LIMIT

MAX_GUIDANCE = 100.0
# "WIDTHxHEIGHT": ASCII digits, no 0 and no leading zeros; the OpenAPI document states this very pattern
SIZE_PATTERN = r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$"


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: str
    n: int = 1
    size: str | None = Field(None, description='"WIDTHxHEIGHT"; default: the native size')
    response_format: str = "b64_json"
    output_format: str = "png"
    model: str | None = None
    user: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = Field(None, description="image i uses seed + i; default: random")
    scheduler: str | None = Field(None, description="default, or one the model's family supports")


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str
    seed: int


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    size: str
    output_format: Literal["png"] = "png"


def parse_size(size: str) -> tuple[int, int]:
    if not re.fullmatch(SIZE_PATTERN, size):
        raise InvalidRequest("size", f"must be WIDTHxHEIGHT in pixels, e.g. 512x512, got {size!r}")
    width, height = size.split("x")
    return int(width), int(height)


def generation_requests(
    body: ImageGenerationRequest, served_name: str, max_n: int
) -> list[GenerationRequest]:
    """One pipeline request per image; InvalidRequest names what the wire format does not allow."""
    if not 1 <= body.n <= max_n:  # before building n requests
        raise InvalidRequest("n", f"must be between 1 and {max_n}, got {body.n}", "DIFFSHARD_MAX_N")
    if body.response_format != "b64_json":
        raise InvalidRequest("response_format", f"only b64_json is served, got {body.response_format!r}")
    if body.output_format != "png":
        raise InvalidRequest("output_format", f"only png is served, got {body.output_format!r}")
    if body.model is not None and body.model != served_name:
        raise InvalidRequest("model", f"this server serves {served_name!r}, not {body.model!r}")
    width, height = parse_size(body.size) if body.size is not None else (None, None)
    guidance = body.guidance_scale
    if guidance is not None and not (math.isfinite(guidance) and 0 <= guidance <= MAX_GUIDANCE):
        raise InvalidRequest("guidance_scale", f"must be between 0 and {MAX_GUIDANCE:g}, got {guidance}")
    if body.seed is not None and not 0 <= body.seed < SEED_LIMIT:
        raise InvalidRequest("seed", f"must be between 0 and {SEED_LIMIT - 1}, got {body.seed}")
    seed = secrets.randbelow(SEED_LIMIT) if body.seed is None else body.seed
    return [
        GenerationRequest(
            prompt=body.prompt,
            negative_prompt=body.negative_prompt,
            seed=(seed + i) % SEED_LIMIT,
            steps=body.num_inference_steps,
            guidance_scale=guidance,
            scheduler=body.scheduler,
            width=width,
            height=height,
        )
        for i in range(body.n)
    ]
