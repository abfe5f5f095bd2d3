"""A finished video's content, as `/v1/videos/{id}/content` serves it: an H.264 MP4 (PyAV's
FFmpeg, libx264, yuv420p: lossy, as every MP4 a browser plays), its frames as PNGs in a ZIP (a
lossless variant, so a client can check exact pixels), its first frame as the thumbnail, and a
spritesheet (up to 8 frames evenly spaced, side by side). Written off the step loop."""

from __future__ import annotations

import io
import zipfile

import numpy as np
from PIL import Image

from server.media.images import to_uint8

VARIANTS = {  # variant → (file, media type)
    "video": ("video.mp4", "video/mp4"),
    "thumbnail": ("thumbnail.png", "image/png"),
    "spritesheet": ("spritesheet.png", "image/png"),
    "frames": ("frames.zip", "application/zip"),
}
SPRITES = 8


def video_files(frames: np.ndarray, fps: int) -> dict[str, bytes]:
    """Every variant of `frames` ([F, H, W, 3] in [0, 1]), file name → bytes."""
    pixels = to_uint8(np.clip(frames, 0, 1))  # [F, H, W, 3], rounded as diffusers' `numpy_to_pil`
    picks = np.linspace(0, len(pixels) - 1, min(SPRITES, len(pixels))).round().astype(int)
    frames_zip = io.BytesIO()
    with zipfile.ZipFile(frames_zip, "w") as archive:
        for index, frame in enumerate(pixels):
            archive.writestr(f"frame_{index:04d}.png", _png(frame))
    return {
        VARIANTS["video"][0]: _mp4(pixels, fps),
        VARIANTS["thumbnail"][0]: _png(pixels[0]),
        VARIANTS["spritesheet"][0]: _png(np.concatenate(list(pixels[picks]), axis=1)),
        VARIANTS["frames"][0]: frames_zip.getvalue(),
    }


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _mp4(pixels: np.ndarray, fps: int) -> bytes:
    import av  # PyAV (36 MB, FFmpeg inside) where a video is encoded: image-only hosts go without

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = pixels.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()
