"""The OpenAPI document, told truthfully: built once, at app creation, from the settings.

FastAPI's generated document knows neither the service's limits (they are settings, and
the model's native size sets the pixel limit) nor its errors: it promises a 422 this service
never sends (validation errors answer 400) and lists none of the statuses it does send. Here
each body field carries its real bounds, each operation lists every status it answers (with
OpenAI's error envelope), and the bearer scheme is declared when the server has keys. Clients
and contract testers (schemathesis) can then trust it: an example inside the schema gets a
documented answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.api.schemas import (
    HONOURED,
    MAX_GUIDANCE,
    MAX_PARTIAL_IMAGES,
    RANDOM_SEED,
    SIZE_PATTERN,
    ImageEditRequest,
    backgrounds,
)
from server.api.videos import VideoCreateRequest
from server.media.images import FORMATS
from server.requests import DEFAULT_INTERVAL, DEFAULT_THRESHOLD, MAX_INTERVAL, MAX_MODEL_STEPS, SEED_LIMIT
from server.serving.jobs import PRIORITIES

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "enum": ["invalid_request_error", "server_error"]},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "string"},
            },
        }
    },
}
ERRORS = {
    400: "invalid input: the message names the field (`param`) and the limit or setting",
    401: "a missing or wrong API key (`WWW-Authenticate: Bearer`)",
    408: "the body did not arrive within DIFFSHARD_READ_TIMEOUT_S; the connection is closed",
    404: "no such video job, batch or file (or not this key's), or this server's model makes images, "
    "not videos",
    409: "the video job has not completed (content), or the batch has ended (cancel)",
    413: "the body is over DIFFSHARD_MAX_BODY_BYTES (edits: over their images' limits beside it)",
    429: "this API key has DIFFSHARD_MAX_QUEUE_PER_KEY video jobs, or DIFFSHARD_BATCH_MAX_PER_KEY "
    "batches, unfinished (Retry-After)",
    500: "the generation failed; the message carries the request id the server log names",
    503: "not ready (code: loading, draining, failed, unhealthy), the queue is full (Retry-After), "
    "out of device memory (x-should-retry: false), or too many connections",
    504: "the request ran past DIFFSHARD_REQUEST_TIMEOUT_S",
    507: "the upload does not fit the batch files' room (DIFFSHARD_BATCH_STORE_BYTES)",
}
# Statuses each operation answers besides 200 (and 401 on /v1/* when the server has keys).
# 499 (the client left) is never sent: nobody is listening.
OPERATION_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/images/generations"): (400, 408, 413, 500, 503, 504),
    ("post", "/v1/images/edits"): (400, 408, 413, 500, 503, 504),
    ("post", "/v1/videos"): (400, 404, 408, 413, 429, 503),
    ("get", "/v1/videos"): (400, 404, 503),
    ("get", "/v1/videos/{video_id}"): (404, 503),
    ("get", "/v1/videos/{video_id}/content"): (400, 404, 409, 503),
    ("delete", "/v1/videos/{video_id}"): (404, 503),
    ("post", "/v1/videos/{video_id}/cancel"): (404, 503),
    ("post", "/v1/files"): (400, 408, 413, 503, 507),
    ("get", "/v1/files"): (400, 503),
    ("get", "/v1/files/{file_id}"): (404, 503),
    ("get", "/v1/files/{file_id}/content"): (404, 503),
    ("delete", "/v1/files/{file_id}"): (404, 503),
    ("post", "/v1/batches"): (400, 404, 429, 503),
    ("get", "/v1/batches"): (400, 503),
    ("get", "/v1/batches/{batch_id}"): (404, 503),
    ("post", "/v1/batches/{batch_id}/cancel"): (404, 409, 503),
    ("get", "/v1/models"): (503,),
    ("get", "/v1/shards"): (503,),
    ("get", "/v1/stats"): (503,),
    ("get", "/livez"): (503,),
    ("get", "/readyz"): (503,),
}
DEFAULT_ERRORS = (503,)  # any operation, once the connection cap is reached
# Each step-caching policy's parameters, as an object's properties (stepcache.parse_step_cache).
STEP_CACHE_PARAMETERS: dict[str, dict[str, Any]] = {
    "off": {},
    "deep": {
        "interval": {
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_INTERVAL,
            "default": DEFAULT_INTERVAL,
            "description": "the whole UNet every `interval` steps, only its shallow blocks between",
        }
    },
    "first_block": {
        "threshold": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "default": DEFAULT_THRESHOLD,
            "description": "skip the other blocks while the first block's output changes less than this",
        }
    },
}
REQUEST_ID = {
    "x-request-id": {
        "description": "the request's id: the client's x-request-id if short and plain, else a new one",
        "schema": {"type": "string"},
    }
}


@dataclass(frozen=True)
class Bounds:
    """What the document states about request bodies: the service's limits and the model's."""

    served_name: str
    max_n: int
    max_steps: int
    max_prompt_chars: int
    max_pixels: int
    max_work: float
    native_size: int
    size_multiple: int
    max_side: int | None
    schedulers: tuple[str, ...]
    keyed: bool
    step_caches: tuple[str, ...] = ("off",)  # the family's step-caching policies
    step_cache: str | dict[str, Any] = "off"  # the server's --step-cache, as a request sends it
    alpha: bool = False  # its images carry an alpha channel: background transparent is served


def install_openapi(app: FastAPI, bounds: Bounds) -> None:
    """Build the document now (after every route is included) and serve it as /openapi.json."""
    document = openapi_document(app, bounds)
    app.openapi_schema = document
    app.openapi = lambda: document  # type: ignore[method-assign]


def openapi_document(app: FastAPI, bounds: Bounds) -> dict[str, Any]:
    document = get_openapi(
        title=app.title,
        version=app.version,
        description="OpenAI's Images API on a diffusion model sharded across devices. Every error is "
        "OpenAI's envelope; every response carries x-request-id.",
        routes=app.routes,
    )
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas["Error"] = ERROR_SCHEMA
    _bound_body(schemas["ImageGenerationRequest"], bounds)
    schemas["ImageEditRequest"] = _edit_form(bounds)
    schemas["VideoCreateRequest"] = VideoCreateRequest.model_json_schema()  # read by hand: JSON or form
    document["paths"]["/v1/images/edits"]["post"]["requestBody"] = {
        "required": True,
        "content": {"multipart/form-data": {"schema": {"$ref": "#/components/schemas/ImageEditRequest"}}},
    }
    if bounds.keyed:
        components["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "one of DIFFSHARD_API_KEY_FILE's keys",
            }
        }
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            statuses = list(OPERATION_ERRORS.get((method, path), DEFAULT_ERRORS))
            if bounds.keyed and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
                statuses.append(401)
            operation["responses"] = _responses(operation["responses"], statuses)
    return document


def _responses(generated: dict[str, Any], statuses: Iterable[int]) -> dict[str, Any]:
    responses = {code: spec for code, spec in generated.items() if code != "422"}
    for status in sorted(statuses):
        responses[str(status)] = {
            "description": ERRORS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    for spec in responses.values():
        spec.setdefault("headers", {}).update(REQUEST_ID)
    return responses


def _bound_body(schema: dict[str, Any], b: Bounds) -> None:
    """Each field of the Images API body with the bounds the service enforces."""
    props = schema["properties"]
    side = f", each side at most {b.max_side}" if b.max_side else ""
    props["prompt"].update(minLength=1, maxLength=b.max_prompt_chars, pattern=r"\S")
    props["prompt"]["description"] = "what to draw: not blank, at most DIFFSHARD_MAX_PROMPT_CHARS characters"
    props["n"].update(minimum=1, maximum=b.max_n, description="images (DIFFSHARD_MAX_N)")
    _nullable(
        props["size"],
        pattern=SIZE_PATTERN,
        examples=[f"{b.native_size}x{b.native_size}"],
        description=f'"WIDTHxHEIGHT" in pixels, multiples of {b.size_multiple}{side}, '
        f"width x height at most {b.max_pixels} (DIFFSHARD_MAX_PIXELS); default: the native size, "
        f"{b.native_size}x{b.native_size}",
    )
    props["response_format"].update(enum=["b64_json"])
    props["output_format"].update(enum=list(FORMATS))
    _nullable(props["output_compression"], minimum=0, maximum=100)
    for field, allowed in HONOURED.items():
        _nullable(props[field], enum=list(allowed))
    _nullable(
        props["background"],
        enum=list(backgrounds(b.alpha)),
        description="transparent: RGBA png or webp (jpeg: 400); opaque: over white; auto: transparent "
        "where the format keeps alpha"
        if b.alpha
        else "this model makes opaque images: auto and opaque are the same, transparent answers 400",
    )
    _nullable(props["partial_images"], minimum=0, maximum=MAX_PARTIAL_IMAGES, description="with stream: true")
    props["stream_progress"]["description"] = (
        "with stream: true, diffshard.progress events (status, queue_position, step of steps)"
    )
    props["style"]["description"] = "not supported (400): describe the style in the prompt"
    _nullable(props["model"], enum=[b.served_name], description="the served model's id, if given")
    _nullable(props["negative_prompt"], maxLength=b.max_prompt_chars)
    _nullable(
        props["num_inference_steps"],
        minimum=1,
        maximum=min(b.max_steps, MAX_MODEL_STEPS),
        description="denoising steps (DIFFSHARD_MAX_STEPS); default: the model's",
    )
    _nullable(props["guidance_scale"], minimum=0, maximum=MAX_GUIDANCE)
    _nullable(props["true_cfg_scale"], minimum=0, maximum=MAX_GUIDANCE)
    _nullable(props["seed"], minimum=RANDOM_SEED, maximum=SEED_LIMIT - 1)
    _nullable(props["scheduler"], enum=list(b.schedulers))
    props["step_cache"] = _step_cache(b)
    props["priority"].update(enum=list(PRIORITIES))
    schema["description"] = (
        f"OpenAI's image generation body plus diffshard's extensions. One request's work, "
        f"n x num_inference_steps x width x height / {b.native_size}², is at most {b.max_work:g} "
        f"(DIFFSHARD_MAX_WORK); beyond it, 400. OpenAI fields that would change the images but "
        f"cannot be honoured (background transparent in jpeg or on a model without alpha, style, "
        f"other qualities) answer 400; fields nobody defines are ignored."
    )


def _edit_form(b: Bounds) -> dict[str, Any]:
    """The edit's multipart fields: the generation body's, bounded alike, and its files."""
    schema = ImageEditRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    _bound_body(schema, b)
    props = schema["properties"]
    binary = {"type": "string", "format": "binary"}
    props["image"] = {
        **binary,
        "description": "the PNG, JPEG or WebP image to edit (several: image[], up to "
        "DIFFSHARD_MAX_EDIT_IMAGES), at most DIFFSHARD_MAX_IMAGE_BYTES and DIFFSHARD_MAX_IMAGE_PIXELS",
    }
    props["mask"] = {
        **binary,
        "description": "a PNG of the image's size whose fully transparent pixels mark what to repaint, "
        "the others coming back as sent unless keep_unmasked is false (applies to the first image); "
        "without it, the whole image is restyled (img2img)",
    }
    _nullable(
        props["size"],
        pattern=rf"^auto$|{SIZE_PATTERN}",
        description='"WIDTHxHEIGHT" (the image is resized to it) or "auto"; default: the image\'s size',
    )
    _nullable(props["strength"], exclusiveMinimum=0, maximum=1)
    _nullable(props["input_fidelity"], enum=["low", "high"])
    props["lora"] = {
        "type": "string",
        "description": 'a JSON object of adapters and scales, e.g. {"style": 0.8}',
    }
    props["control"] = {
        "type": "string",
        "contentMediaType": "application/json",
        "description": 'a JSON list of controls, as generations take them, e.g. [{"model": "edges", '
        '"image": "<base64>", "scale": 0.8}]',
    }
    step_cache = props["step_cache"]
    default = step_cache.get("default")
    props["step_cache"] = {  # a form's fields are text: the policy's name, or its object as JSON
        "anyOf": [
            step_cache["anyOf"][0],
            {"type": "string", "contentMediaType": "application/json", "pattern": r"^\s*\{"},
        ],
        "description": step_cache["description"] + "; the object as JSON text",
        **({"default": default if isinstance(default, str) else json.dumps(default)} if default else {}),
    }
    schema["required"] = ["prompt", "image"]
    schema["description"] = "OpenAI's image edit form plus diffshard's extensions, as text fields."
    return schema


def _step_cache(b: Bounds) -> dict[str, Any]:
    """`step_cache`: the served family's policies, by name (their default parameters) or as an
    object with its parameter; absent, the server's --step-cache."""
    policies = list(b.step_caches)
    objects = [
        {
            "type": "object",
            "properties": {
                "policy": {"type": "string", "const": policy},
                **STEP_CACHE_PARAMETERS.get(policy, {}),
            },
            "required": ["policy"],
            "additionalProperties": False,
        }
        for policy in policies
    ]
    prop: dict[str, Any] = {
        "anyOf": [{"type": "string", "enum": policies}, *objects, {"type": "null"}],
        "description": "step caching: reuse the last steps' deep features, faster but the images change a "
        f"little. This model takes {', '.join(policies)}: by name at its defaults, or as an object with "
        f"its parameter; absent, the server's --step-cache, here {json.dumps(b.step_cache)}",
    }
    return {**prop, "default": b.step_cache}


def _nullable(prop: dict[str, Any], *, description: str | None = None, **bounds: Any) -> None:
    """Bound the non-null branch of an optional field's `anyOf`."""
    for branch in prop["anyOf"]:
        if branch.get("type") != "null":
            branch.update(bounds)
    if description:
        prop["description"] = description
