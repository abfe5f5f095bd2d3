"""Images sent to /v1/images/edits, decoded safely: untrusted bytes are bounded before Pillow
allocates anything.

Each file is checked in this order: its bytes against `max_image_bytes`; a PNG's every chunk
against its CRC (Pillow skips the image data's); its format (PNG, JPEG or WebP; a mask: PNG, as
OpenAI asks) from its header; its width x height, also read from the header, against
`max_image_pixels` (a 20 000 x 20 000 PNG of a few hundred bytes is refused here, never decoded:
Pillow's own decompression-bomb limit, set from the same bound at startup, is a second fence).
Only then are the pixels decoded. Every refusal is an InvalidRequest naming the field (`image`,
`mask`) and, for a limit, its setting.

OpenAI's mask marks the region to repaint by full transparency (alpha 0); diffusers' mask marks
it white. `mask_to_repaint` turns one into the other.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import struct
import warnings
import zlib

from PIL import Image, ImageOps, UnidentifiedImageError

from server.errors import InvalidRequest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MASK_FORMATS = ("PNG",)
DATA_URL = re.compile(r"data:image/[a-z]+;base64,", re.IGNORECASE)
DATA_URL_PREFIX = 64  # bytes allowed for a data URL's "data:image/...;base64," before the image


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
    if data.startswith(PNG_SIGNATURE):
        check_png_chunks(data, field)
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


def read_base64_image(text: str, field: str, *, max_bytes: int, max_pixels: int) -> Image.Image:
    """An image sent inside JSON, as base64 or a data URL of it: its length bounded before it is
    decoded, then `read_image`'s checks."""
    encoded = text[found.end() :] if (found := DATA_URL.match(text)) else text
    if len(encoded) > 4 * math.ceil(max_bytes / 3):
        message = f"is over {max_bytes} bytes once decoded; the limit is {max_bytes}"
        raise InvalidRequest(field, message, "DIFFSHARD_MAX_IMAGE_BYTES")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(field, "is not base64 (or a data:image/png;base64,... URL)") from None
    return read_image(data, field, max_bytes=max_bytes, max_pixels=max_pixels)


def check_png_chunks(data: bytes, field: str) -> None:
    """Every chunk's CRC, up to IEND: Pillow skips the image data's (IDAT) CRCs, so a corrupted
    upload would be decoded into whatever its damaged bytes say. Strict: a bad CRC, a chunk
    running past the end or no IEND is refused."""
    at = len(PNG_SIGNATURE)
    while True:
        if at + 12 > len(data):
            raise InvalidRequest(field, "is a truncated PNG: it ends before its IEND chunk")
        (length,) = struct.unpack_from(">I", data, at)
        kind_and_data = memoryview(data)[at + 4 : at + 8 + length]  # no copy of a large IDAT
        if at + 12 + length > len(data):
            raise InvalidRequest(field, "is a truncated PNG: a chunk runs past the end of the file")
        (crc,) = struct.unpack_from(">I", data, at + 8 + length)
        if zlib.crc32(kind_and_data) != crc:
            kind = bytes(kind_and_data[:4]).decode("latin-1", "replace")
            raise InvalidRequest(field, f"is a corrupt PNG: its {kind!r} chunk fails its CRC check")
        if bytes(kind_and_data[:4]) == b"IEND":
            return
        at += 12 + length


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
