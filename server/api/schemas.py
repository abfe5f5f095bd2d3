"""Request and response bodies of the Images API, and their translation into pipeline requests.

The body follows OpenAI's `POST /v1/images/generations` (and, as multipart form fields beside
the files, `POST /v1/images/edits`: `ImageEditRequest`); diffshard's extensions
(negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, seed, scheduler,
stream_progress, deterministic, lora, step_cache, priority) sit beside the standard fields,
where the SDKs put `extra_body`. Types are checked strictly ("2" is not an integer). OpenAI's
other fields are honoured where this service can (`output_format` png, jpeg or webp with
`output_compression`; `quality` auto or standard: the model's own settings; `background` as
`image_background` says; `moderation` low: none is done; `complexity` low: no planning is done)
and refused with a 400 naming the field where honouring them would change the images
(`background: transparent` in jpeg or on a model without alpha, `style`, other qualities, gif
and svg output); `user` and `safety_identifier` are accepted and unused. Any other field is
refused with a 400 naming it: a typo (`num_inference_step`) must not run silently with defaults.
What the wire format decides is checked here; the service's limits and the model's invariants
are checked by the serving layer when the job is submitted.
"""

from __future__ import annotations

import base64
import json
import math
import re
import secrets
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.api.uploads import read_base64_image
from server.errors import InvalidRequest
from server.media.images import ALPHA_FORMATS, FORMATS
from server.requests import MAX_CONTROLS, SEED_LIMIT, Control, Edit, GenerationRequest, parse_step_cache
from server.serving import Limits
from server.serving.jobs import INTERACTIVE

MAX_GUIDANCE = 100.0
RANDOM_SEED = -1  # as A1111's: the server draws one (and answers it with each image)
MAX_PARTIAL_IMAGES = 3  # OpenAI's bound
MAX_LORA_SCALE = 4.0  # beyond it an adapter only saturates the image
MAX_LORAS = 8  # adapters one request may combine
# "WIDTHxHEIGHT": ASCII digits, no 0 and no leading zeros; the OpenAPI document states this very pattern
SIZE_PATTERN = r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$"
# OpenAI fields and the values honoured: each means what this service does anyway.
HONOURED = {
    "quality": ("auto", "standard", "high"),  # the model's own steps and guidance (its high)
    "moderation": ("low",),  # no moderation is done
    "complexity": ("low",),  # no computation is spent planning the image
}
WHY_NOT = {
    "quality": "set num_inference_steps for more or fewer steps",
    "moderation": "diffshard does no content moderation",
    "complexity": "diffshard spends no computation planning images; set num_inference_steps",
}
# OpenAI's `background`: what a model with an alpha channel honours, and one without
BACKGROUNDS = ("transparent", "opaque", "auto")
OPAQUE_BACKGROUNDS = ("opaque", "auto")
Background = Literal["transparent", "opaque"]  # what an image is: with its alpha, or without
# OpenAI fields for output this service does not make: null or absent only.
UNSERVED = {
    "style": "describe the style in the prompt",
    "frame_count": "gif output is not served",
    "frame_duration_ms": "gif output is not served",
    "svg": "svg output is not served",
}


class ControlField(BaseModel):
    """One control: a served ControlNet (GET /v1/models lists them), its image, and its weight."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    image: str = Field(description="the control image (edges, depth, pose...): base64, or a data URL")
    scale: float = Field(1.0, description="its residuals' weight, 0 to 2 (controlnet_conditioning_scale)")
    start: float = Field(0.0, description="the share of the steps before it acts, 0 <= start < end")
    end: float = Field(1.0, description="the share of the steps after which it stops, end <= 1")


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str
    n: int = 1
    size: str | None = Field(None, description='"WIDTHxHEIGHT"; default: the native size')
    response_format: str = "b64_json"
    output_format: str = "png"
    output_compression: int | None = Field(None, description="jpeg and webp: encoder quality 0-100")
    stream: bool = False
    partial_images: int | None = Field(None, description="with stream: previews of each image, 0-3")
    stream_progress: bool = Field(False, description="with stream: diffshard.progress events")
    quality: str | None = None
    background: str | None = None
    moderation: str | None = None
    style: str | None = None
    complexity: str | None = None
    frame_count: int | None = None
    frame_duration_ms: int | None = None
    svg: dict | None = None
    model: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = Field(
        None, description="guidance-distilled models (FLUX.1): classifier-free guidance with negative_prompt"
    )
    seed: int | None = Field(
        None, description="image i uses seed + i; absent or -1: random (each image's seed is answered)"
    )
    scheduler: str | None = Field(None, description="default, or one the model's family supports")
    lora: dict[str, float] | None = Field(
        None,
        description=f"LoRA adapters (GET /v1/models lists them) and their scales, -{MAX_LORA_SCALE:g} to "
        f"{MAX_LORA_SCALE:g}, at most {MAX_LORAS}",
    )
    deterministic: bool = Field(
        False,
        description="its rows run in calls of their own, so the same seed gives the same bytes "
        "whatever else is batched (slower under load)",
    )
    control: list[ControlField] | None = Field(
        None, description=f"ControlNets guiding the layout, at most {MAX_CONTROLS} (Multi-ControlNet)"
    )
    # any JSON: parse_step_cache checks it, so every bad value gets its one message
    step_cache: object = Field(
        None,
        description='reuse the last steps\' deep features: "off", "deep" (UNets) or "first_block" '
        '(MMDiTs) at their defaults, or {"policy": "deep", "interval": 1-10} / {"policy": '
        '"first_block", "threshold": 0-1}; faster, images change a little; default: the server\'s '
        "--step-cache",
    )
    # checked where the service takes it (Service.submit), so every caller gets its one message
    priority: str = Field(
        INTERACTIVE,
        description="interactive, or background: the request takes only the rows and time interactive "
        "requests leave, so it may wait longer; any key may lower its own",
    )


class ImageEditRequest(ImageGenerationRequest):
    """`POST /v1/images/edits`' fields beside its files (`image`, `mask`): form fields are text,
    so numbers and booleans are read from it ("2", "true"), `lora` is a JSON object and `control`
    a JSON list."""

    model_config = ConfigDict(strict=False, extra="forbid")

    size: str | None = Field(None, description='"WIDTHxHEIGHT" or "auto"; default: the image\'s size')
    strength: float | None = Field(
        None,
        description="how far from the image, 0 < s <= 1: its share of the steps run; default 0.8, "
        "with a mask 1.0",
    )
    input_fidelity: str | None = Field(
        None,
        description='OpenAI\'s, "low" (default) or "high": with a mask both keep the pixels it leaves '
        'opaque exactly; "high" needs a mask (without one, a lower strength keeps closer)',
    )
    keep_unmasked: bool = Field(
        True,
        description="with a mask: true returns the pixels it leaves opaque exactly as sent; "
        "false returns the model's whole image, every pixel decoded by its VAE",
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _json_object(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError(
                    'must be a JSON object of adapter names and scales, e.g. {"style": 0.8}'
                ) from None
        return value


Quality = Literal["low", "medium", "high"]


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str
    seed: int = Field(description="the seed that made this image: send it to make it again")


class TokenDetails(BaseModel):
    image_tokens: int = 0
    text_tokens: int = 0


class Usage(BaseModel):
    """OpenAI's token usage; diffshard counts no tokens, so every count is 0."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: TokenDetails = TokenDetails()


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    size: str
    output_format: Literal["png", "jpeg", "webp"] = "png"
    quality: Quality = Field(description="the quality used: quality_of(steps run)")
    background: Background = Field("opaque", description="transparent: the image has an alpha channel")
    usage: Usage = Usage()


def images_response(
    body: ImageGenerationRequest,
    requests: list[GenerationRequest],
    encoded: list[bytes],
    recommended_steps: int,
    background: Background,
) -> ImagesResponse:
    """The Images API's answer: each request's encoded image with its seed (a route's, or a batch
    line's output)."""
    first = requests[0]
    return ImagesResponse(
        created=int(time.time()),
        quality=quality_of(first.steps, recommended_steps),
        data=[
            ImageData(b64_json=base64.b64encode(data).decode(), revised_prompt=body.prompt, seed=r.seed)
            for r, data in zip(requests, encoded, strict=True)
        ],
        size=first.output_size,
        output_format=body.output_format,
        background=background,
    )


def quality_of(steps: int, recommended: int) -> Quality:
    """The quality an image was made at, in OpenAI's words, by its steps against the model's
    recommended count: high at it or above, medium from half of it, low below."""
    if steps >= recommended:
        return "high"
    return "medium" if 2 * steps >= recommended else "low"


def parse_size(size: str) -> tuple[int, int]:
    if not re.fullmatch(SIZE_PATTERN, size):
        raise InvalidRequest("size", f"must be WIDTHxHEIGHT in pixels, e.g. 512x512, got {size!r}")
    width, height = size.split("x")
    return int(width), int(height)


def read_controls(fields: list[ControlField] | None, limits: Limits) -> tuple[Control, ...]:
    """A request's `control`, each image decoded within the image limits (InvalidRequest naming
    `control[i].image`); whether each names a served ControlNet, and its ranges, the pipeline
    checks with the rest of the request."""
    fields = fields or []
    if len(fields) > MAX_CONTROLS:
        raise InvalidRequest("control", f"at most {MAX_CONTROLS} controls a request; got {len(fields)}")
    bounds = {"max_bytes": limits.max_image_bytes, "max_pixels": limits.max_image_pixels}
    return tuple(
        Control(f.model, read_base64_image(f.image, f"control[{i}].image", **bounds), f.scale, f.start, f.end)
        for i, f in enumerate(fields)
    )


def checked_lora(lora: dict[str, float] | None) -> tuple[tuple[str, float], ...]:
    """A request's `lora` as (adapter, scale) pairs, within MAX_LORAS and ±MAX_LORA_SCALE (whether
    the adapters exist is the pipeline's check)."""
    lora = lora or {}
    if len(lora) > MAX_LORAS:
        raise InvalidRequest("lora", f"at most {MAX_LORAS} adapters a request, got {len(lora)}")
    for name, scale in lora.items():
        if not (math.isfinite(scale) and -MAX_LORA_SCALE <= scale <= MAX_LORA_SCALE):
            raise InvalidRequest(
                "lora",
                f"{name}: scale must be between {-MAX_LORA_SCALE:g} and {MAX_LORA_SCALE:g}, got {scale}",
            )
    return tuple(lora.items())


def check_output(body: ImageGenerationRequest) -> None:
    """The OpenAI fields about the output: honoured, or refused naming the field."""
    if body.output_format not in FORMATS:
        raise InvalidRequest(
            "output_format", f"must be one of {', '.join(FORMATS)}, got {body.output_format!r}"
        )
    compression = body.output_compression
    if compression is not None:
        if body.output_format == "png":
            raise InvalidRequest("output_compression", "applies to jpeg and webp only; png is lossless")
        if not 0 <= compression <= 100:
            raise InvalidRequest("output_compression", f"must be between 0 and 100, got {compression}")
    for field, why in UNSERVED.items():
        if getattr(body, field) is not None:
            raise InvalidRequest(field, f"is not supported: {why}")
    for field, allowed in HONOURED.items():
        value = getattr(body, field)
        if value is not None and value not in allowed:
            raise InvalidRequest(field, f"must be {' or '.join(allowed)}, got {value!r}: {WHY_NOT[field]}")


def backgrounds(alpha: bool) -> tuple[str, ...]:
    """The `background` values a model takes: transparent only where it decodes an alpha channel."""
    return BACKGROUNDS if alpha else OPAQUE_BACKGROUNDS


def image_background(body: ImageGenerationRequest, alpha: bool) -> Background:
    """What the images will be (the response's `background`), for a model with or without an
    alpha channel; InvalidRequest naming `background` where it cannot be honoured. Transparent
    keeps the alpha (png, webp); opaque composites over white; auto keeps it where the format
    can. A model without alpha makes opaque images whatever is asked short of transparent."""
    asked = body.background or "auto"
    if asked not in BACKGROUNDS:
        raise InvalidRequest("background", f"must be {' or '.join(backgrounds(alpha))}, got {asked!r}")
    if asked == "transparent" and body.output_format not in ALPHA_FORMATS:
        why = f"{body.output_format.upper()} has no alpha channel; use png or webp"
        raise InvalidRequest("background", f"cannot be transparent in {body.output_format}: {why}")
    if asked == "transparent" and not alpha:
        allowed = " or ".join(OPAQUE_BACKGROUNDS)
        why = "this model makes opaque images"
        raise InvalidRequest("background", f"must be {allowed}, got 'transparent': {why}")
    keeps = asked == "transparent" or (asked == "auto" and body.output_format in ALPHA_FORMATS)
    return "transparent" if alpha and keeps else "opaque"


def generation_requests(
    body: ImageGenerationRequest,
    served_name: str,
    max_n: int,
    edits: list[Edit] | None = None,
    controls: tuple[Control, ...] = (),
) -> list[GenerationRequest]:
    """One pipeline request per image (with `edits`, n per image edited, in order; `controls`
    from `read_controls`); InvalidRequest names what the wire format does not allow."""
    if not 1 <= body.n <= max_n:  # before building n requests
        raise InvalidRequest("n", f"must be between 1 and {max_n}, got {body.n}", "DIFFSHARD_MAX_N")
    sources = edits or [None]
    if body.n * len(sources) > max_n:
        message = f"n x images is {body.n} x {len(sources)}; the limit is {max_n} images a request"
        raise InvalidRequest("n", message, "DIFFSHARD_MAX_N")
    if body.response_format != "b64_json":
        raise InvalidRequest("response_format", f"only b64_json is served, got {body.response_format!r}")
    check_output(body)
    if body.model is not None and body.model != served_name:
        raise InvalidRequest("model", f"this server serves {served_name!r}, not {body.model!r}")
    auto = edits is not None and body.size == "auto"  # an edit's size: its image's
    width, height = parse_size(body.size) if body.size is not None and not auto else (None, None)
    guidance = body.guidance_scale
    if guidance is not None and not (math.isfinite(guidance) and 0 <= guidance <= MAX_GUIDANCE):
        raise InvalidRequest("guidance_scale", f"must be between 0 and {MAX_GUIDANCE:g}, got {guidance}")
    true_cfg = body.true_cfg_scale
    if true_cfg is not None and not (math.isfinite(true_cfg) and 0 <= true_cfg <= MAX_GUIDANCE):
        raise InvalidRequest("true_cfg_scale", f"must be between 0 and {MAX_GUIDANCE:g}, got {true_cfg}")
    if body.seed is not None and not RANDOM_SEED <= body.seed < SEED_LIMIT:
        message = f"must be between 0 and {SEED_LIMIT - 1}, or -1 for a random one, got {body.seed}"
        raise InvalidRequest("seed", message)
    partials = body.partial_images
    if partials is not None and not body.stream:
        raise InvalidRequest("partial_images", "needs stream: true")
    if body.stream_progress and not body.stream:
        raise InvalidRequest("stream_progress", "needs stream: true")
    if partials is not None and not 0 <= partials <= MAX_PARTIAL_IMAGES:
        raise InvalidRequest("partial_images", f"must be between 0 and {MAX_PARTIAL_IMAGES}, got {partials}")
    lora = checked_lora(body.lora)
    seed = secrets.randbelow(SEED_LIMIT) if body.seed in (None, RANDOM_SEED) else body.seed
    step_cache = None if body.step_cache is None else parse_step_cache(body.step_cache)
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
            partial_images=partials or 0,
            deterministic=body.deterministic,
            lora=lora,
            edit=edit,
            true_cfg_scale=true_cfg,
            step_cache=step_cache,
            control=controls,
        )
        for i, edit in enumerate(edit for edit in sources for _ in range(body.n))
    ]
