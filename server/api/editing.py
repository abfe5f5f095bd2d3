"""`POST /v1/images/edits`' multipart form, read into an `ImageEditRequest` and the `Edit`s the
pipeline runs: the form read part by part within its bounds (multipart.py), files decoded by
uploads.py off the event loop, JSON-valued fields parsed as the JSON route parses its body. An
inpainting keeps the pixels its mask leaves opaque unless `keep_unmasked` is false (see
`check_fidelity`)."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from PIL import Image
from pydantic import ValidationError

from server.api.errors import APIError
from server.api.multipart import FormLimits, read_form
from server.api.schemas import ImageEditRequest
from server.api.uploads import MASK_FORMATS, mask_to_repaint, read_image
from server.errors import InvalidRequest
from server.requests import Edit
from server.serving import Limits

JSON_FIELDS = ("lora", "step_cache", "control", "guidance")  # step_cache: a policy's name, or JSON
MAX_FORM_FIELDS = 64  # text fields: the body's fields, each once
EXAMPLES = {
    "lora": 'an object, e.g. {"style": 0.8}',
    "step_cache": 'an object, e.g. {"policy": "deep", "interval": 3}',
    "control": 'a list, e.g. [{"model": "edges", "image": "<base64>", "scale": 0.8}]',
    "guidance": 'an object, e.g. {"audio_scale": 7, "stg_blocks": [28]}',
}
DEFAULT_STRENGTH = 0.8  # img2img: diffusers' default; inpainting repaints fully (1.0)


async def read_edit_form(
    request: Request, limits: Limits, together: bool = False, alpha: bool = False
) -> tuple[ImageEditRequest, list[Edit]]:
    """The edit's fields and one Edit per image (the mask, if any, on the first, as OpenAI's);
    `together`: one Edit of every image, for a model that edits by reference (FLUX.2); `alpha`:
    the model's VAE takes an alpha channel, so an image with transparency stays RGBA."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        message = f"send an edit as multipart/form-data (image, mask, prompt, ...), not {content_type!r}"
        raise APIError(400, message, code="invalid_content_type")
    form = await read_form(request, form_limits(limits, request.app.state.form_text_bytes))
    try:
        body = ImageEditRequest.model_validate(form_fields(form.fields))
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None
    fidelity = body.input_fidelity
    if fidelity not in (None, "low", "high"):
        raise InvalidRequest("input_fidelity", f"must be low or high, got {fidelity!r}")
    uploads = form.files.get("image", []) + form.files.get("image[]", [])
    if not uploads:
        raise InvalidRequest("image", "is required: the PNG, JPEG or WebP file to edit")
    masks = form.files.get("mask", [])
    check_fidelity(fidelity, body.keep_unmasked, masked=bool(masks))
    bounds = {"max_bytes": limits.max_image_bytes, "max_pixels": limits.max_image_pixels}
    images = [await asyncio.to_thread(read_image, data, "image", **bounds) for data in uploads]
    mask = None
    if masks:
        read = await asyncio.to_thread(read_image, masks[0], "mask", formats=MASK_FORMATS, **bounds)
        mask = mask_to_repaint(read, images[0].size)
    return body, edits_of(body, images, mask, together=together, alpha=alpha)


def edits_of(
    body: ImageEditRequest,
    images: list[Image.Image],
    mask: Image.Image | None,
    *,
    together: bool,
    alpha: bool,
) -> list[Edit]:
    """The Edits of decoded images (the mask, in diffusers' sense, on the first): one per image,
    or one of them all for a model that edits by reference (`together`)."""
    if together:
        strength = 1.0 if body.strength is None else body.strength  # unused: nothing starts from them
        pixels = [edited(image, alpha) for image in images]
        return [Edit(pixels[0], mask, strength, body.keep_unmasked, more=tuple(pixels[1:]))]
    edits = []
    for i, image in enumerate(images):
        masked = mask if i == 0 else None
        strength = body.strength if body.strength is not None else (1.0 if masked else DEFAULT_STRENGTH)
        edits.append(Edit(edited(image, alpha), masked, strength, body.keep_unmasked))
    return edits


def edited(image: Image.Image, alpha: bool) -> Image.Image:
    """An uploaded image as the model takes it: RGBA where its VAE takes alpha and the image has
    transparency (dropping it would show the colours under transparent pixels), else RGB."""
    return image.convert("RGBA") if alpha and image.has_transparency_data else image.convert("RGB")


def form_limits(limits: Limits, max_text_bytes: int) -> FormLimits:
    """The edit form's bounds: its files by the image settings, its text as a JSON body's."""
    return FormLimits(
        max_file_bytes=limits.max_image_bytes,
        max_files=(
            (("image", "image[]"), limits.max_edit_images, "DIFFSHARD_MAX_EDIT_IMAGES"),
            (("mask",), 1, None),
        ),
        max_text_bytes=max_text_bytes,
        max_fields=MAX_FORM_FIELDS,
    )


def form_fields(text: dict[str, str]) -> dict[str, object]:
    """A form's text fields as a JSON body holds them: `lora`, `step_cache` and `guidance` as an
    object, sent either as JSON text or as OpenAI's SDKs send a nested object in a form, a field a
    key (`lora[style]=0.8`, `step_cache[threshold]=0.2`; a list, a field an item:
    `guidance[stg_blocks][]=28`), whose numbers are read as numbers;
    `control`, a list of objects, as JSON text only (a flattened list loses which key is whose)."""
    fields: dict[str, object] = {}
    nested: dict[str, dict[str, object]] = {}
    for name, value in text.items():
        outer, bracket, inner = name.partition("[")
        if bracket and outer == "control":  # a list: SDKs flatten it to control[][model]... fields
            raise InvalidRequest("control", f"send it as one field of JSON text: {EXAMPLES['control']}")
        if bracket and outer in JSON_FIELDS and inner.endswith("][]") and "[" not in inner[:-3]:
            listed = nested.setdefault(outer, {}).setdefault(inner[:-3], [])  # a list: key[]=…, in order
            if isinstance(listed, list):
                listed.append(_number_or_text(value))
        elif bracket and outer in JSON_FIELDS and inner.endswith("]") and "[" not in inner:
            nested.setdefault(outer, {})[inner[:-1]] = _number_or_text(value)
        elif name in JSON_FIELDS and (name != "step_cache" or value.lstrip().startswith("{")):
            fields[name] = json_field(name, value)  # as the JSON route: too deep is a 400, not a crash
        else:
            fields[name] = value
    for name, value in nested.items():
        if name in fields:
            raise InvalidRequest(name, f"send it once: as JSON text or as {name}[KEY] fields, not both")
        fields[name] = value
    return fields


def _number_or_text(value: str) -> object:
    try:
        number = json.loads(value)
    except ValueError:
        return value
    return number if isinstance(number, int | float) and not isinstance(number, bool) else value


def json_field(name: str, text: str) -> object:
    """A form field holding JSON, parsed as the JSON route parses a body."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidRequest(name, "is nested too deeply to parse") from None
    except ValueError:
        raise InvalidRequest(name, f"is not valid JSON: send {EXAMPLES[name]}") from None


def check_fidelity(fidelity: str | None, keep_unmasked: bool, *, masked: bool) -> None:
    """Both fidelities keep a mask's opaque pixels (pixels cannot match closer): "high" only asks
    for what is done, so it is refused where it cannot be (no mask) or contradicts keep_unmasked."""
    if fidelity == "high" and not masked:
        message = "high keeps the pixels a mask leaves opaque: send a mask, or lower strength to stay closer"
        raise InvalidRequest("input_fidelity", message)
    if fidelity == "high" and not keep_unmasked:
        message = "false repaints every pixel, but input_fidelity high keeps the unmasked ones: send one"
        raise InvalidRequest("keep_unmasked", message)
