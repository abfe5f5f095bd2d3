"""`POST /v1/images/edits`' multipart form, read into an `ImageEditRequest` and the `Edit`s the
pipeline runs: files bounded and decoded by uploads.py, off the event loop. An inpainting keeps
the pixels its mask leaves opaque unless `keep_unmasked` is false (see `check_fidelity`)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from server.api.errors import APIError
from server.api.schemas import ImageEditRequest
from server.api.uploads import MASK_FORMATS, mask_to_repaint, read_image
from server.errors import InvalidRequest
from server.serving import Edit, Limits

FILE_FIELDS = ("image", "image[]", "mask")  # the SDK sends several images as image[]
MAX_FORM_FIELDS = 64  # text fields: the body's fields, each once
DEFAULT_STRENGTH = 0.8  # img2img: diffusers' default; inpainting repaints fully (1.0)


async def read_edit_form(request: Request, limits: Limits) -> tuple[ImageEditRequest, list[Edit]]:
    """The edit's fields and one Edit per image (the mask, if any, on the first, as OpenAI's)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        message = f"send an edit as multipart/form-data (image, mask, prompt, ...), not {content_type!r}"
        raise APIError(400, message, code="invalid_content_type")
    form = await request.form(max_files=limits.max_edit_images + 1, max_fields=MAX_FORM_FIELDS)
    try:
        files: dict[str, list[UploadFile]] = {}
        fields: dict[str, str] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile) != (key in FILE_FIELDS):
                what = "a file" if key in FILE_FIELDS else "a text field, not a file"
                raise InvalidRequest(key, f"must be {what}")
            if isinstance(value, UploadFile):
                files.setdefault(key, []).append(value)
            elif key in fields:
                raise InvalidRequest(key, "is given more than once")
            else:
                fields[key] = value
        try:
            body = ImageEditRequest.model_validate(fields)
        except ValidationError as err:
            raise RequestValidationError(err.errors()) from None
        fidelity = body.input_fidelity
        if fidelity not in (None, "low", "high"):
            raise InvalidRequest("input_fidelity", f"must be low or high, got {fidelity!r}")
        uploads = files.get("image", []) + files.get("image[]", [])
        if not uploads:
            raise InvalidRequest("image", "is required: the PNG, JPEG or WebP file to edit")
        if len(uploads) > limits.max_edit_images:
            message = f"{len(uploads)} images; the limit is {limits.max_edit_images}"
            raise InvalidRequest("image", message, "DIFFSHARD_MAX_EDIT_IMAGES")
        masks = files.get("mask", [])
        if len(masks) > 1:
            raise InvalidRequest("mask", f"one mask a request, got {len(masks)}")
        check_fidelity(fidelity, body.keep_unmasked, masked=bool(masks))
        bounds = {"max_bytes": limits.max_image_bytes, "max_pixels": limits.max_image_pixels}
        images = [
            await asyncio.to_thread(read_image, await upload.read(), "image", **bounds) for upload in uploads
        ]
        mask = None
        if masks:
            data = await masks[0].read()
            read = await asyncio.to_thread(read_image, data, "mask", formats=MASK_FORMATS, **bounds)
            mask = mask_to_repaint(read, images[0].size)
    finally:
        await form.close()
    edits = []
    for i, image in enumerate(images):
        masked = mask if i == 0 else None
        strength = body.strength if body.strength is not None else (1.0 if masked else DEFAULT_STRENGTH)
        edits.append(Edit(image.convert("RGB"), masked, strength, body.keep_unmasked))
    return body, edits


def check_fidelity(fidelity: str | None, keep_unmasked: bool, *, masked: bool) -> None:
    """Both fidelities keep a mask's opaque pixels (pixels cannot match closer): "high" only asks
    for what is done, so it is refused where it cannot be (no mask) or contradicts keep_unmasked."""
    if fidelity == "high" and not masked:
        message = "high keeps the pixels a mask leaves opaque: send a mask, or lower strength to stay closer"
        raise InvalidRequest("input_fidelity", message)
    if fidelity == "high" and not keep_unmasked:
        message = "false repaints every pixel, but input_fidelity high keeps the unmasked ones: send one"
        raise InvalidRequest("keep_unmasked", message)
