"""Images sent to /v1/images/edits, decoded safely: untrusted bytes are bounded before Pillow
allocates anything.

Each file is checked in this order: its bytes against `max_image_bytes`; its format (PNG, JPEG
or WebP; a mask: PNG, as OpenAI asks) from its header; its width x height, also read from the
header, against `max_image_pixels` (a 20 000 x 20 000 PNG of a few hundred bytes is refused
here, never decoded: Pillow's own decompression-bomb limit, set from the same bound at startup,
is a second fence). Only then are the pixels decoded. Every refusal is an InvalidRequest naming
the field (`image`, `mask`) and, for a limit, its setting.

OpenAI's mask marks the region to repaint by full transparency (alpha 0); diffusers' mask marks
it white. `mask_to_repaint` turns one into the other.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from server.errors import InvalidRequest

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MASK_FORMATS = ("PNG",)


def bound_decoder(max_pixels: int) -> None:
    """Pillow's decompression-bomb limit from our own bound (it raises past twice its value)."""
    Image.MAX_IMAGE_PIXELS = max_pixels


def read_image(
    data: bytes, field: str, *, max_bytes: int, max_pixels: int, formats: tuple[str, ...] = IMAGE_FORMATS
) -> Image.Image:
    """`data` decoded (its first frame, turned as its EXIF orientation says), or InvalidRequest."""
    if not data:
        raise InvalidRequest(field, "is empty: send a PNG, JPEG or WebP file")
    if len(data) > max_bytes:
        message = f"is {len(data)} bytes; the limit is {max_bytes}"
        raise InvalidRequest(field, message, "DIFFSHARD_MAX_IMAGE_BYTES")
    named = " or ".join(f.lower() for f in formats)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(formats))  # the header only
            width, height = image.size
            if width * height > max_pixels:
                message = f"is {width}x{height}, {width * height} pixels; the limit is {max_pixels}"
                raise InvalidRequest(field, message, "DIFFSHARD_MAX_IMAGE_PIXELS")
            image.load()
            return ImageOps.exif_transpose(image)
    except InvalidRequest:
        raise
    except UnidentifiedImageError:
        raise InvalidRequest(field, f"is not a {named} image") from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        message = f"declares more pixels than the limit, {max_pixels}: it was not decoded"
        raise InvalidRequest(field, message, "DIFFSHARD_MAX_IMAGE_PIXELS") from None
    except (OSError, SyntaxError, ValueError) as err:  # truncated or corrupt data
        raise InvalidRequest(
            field, f"could not be decoded as a {named} image ({type(err).__name__})"
        ) from None


def mask_to_repaint(mask: Image.Image, image_size: tuple[int, int]) -> Image.Image:
    """OpenAI's mask (alpha 0: repaint) as diffusers' (white: repaint), checked against the image."""
    if mask.size != image_size:
        wanted, given = "x".join(map(str, image_size)), "x".join(map(str, mask.size))
        raise InvalidRequest("mask", f"must have the image's size, {wanted}, got {given}")
    if "A" not in mask.getbands() and "transparency" not in mask.info:
        raise InvalidRequest(
            "mask", "has no alpha channel: its fully transparent pixels mark what to repaint"
        )
    alpha = mask.convert("RGBA").getchannel("A")
    repaint = alpha.point(lambda a: 255 if a == 0 else 0)
    if repaint.getextrema()[1] == 0:
        raise InvalidRequest("mask", "has no fully transparent pixel: it marks nothing to repaint")
    return repaint
