"""A finished video's content, as `/v1/videos/{id}/content` serves it: an H.264 MP4 (PyAV's
FFmpeg, libx264, yuv420p: lossy, as every MP4 a browser plays), its frames as PNGs in a ZIP (a
lossless variant, so a client can check exact pixels), its first frame as the thumbnail, and a
spritesheet (up to 8 frames evenly spaced, side by side). Written off the step loop."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import av
import numpy as np
from PIL import Image

VARIANTS = {  # variant → (file, media type)
    "video": ("video.mp4", "video/mp4"),
    "thumbnail": ("thumbnail.png", "image/png"),
    "spritesheet": ("spritesheet.png", "image/png"),
    "frames": ("frames.zip", "application/zip"),
}
SPRITES = 8


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """[F, H, W, 3] floats in [0, 1] → uint8, rounded as diffusers' `numpy_to_pil`."""
    return (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)


def write_video_files(frames: np.ndarray, folder: Path, fps: int) -> int:
    """Every variant of `frames` ([F, H, W, 3] in [0, 1]) in `folder`; their bytes in all."""
    folder.mkdir(parents=True, exist_ok=True)
    pixels = to_uint8(frames)
    _mp4(pixels, folder / VARIANTS["video"][0], fps)
    Image.fromarray(pixels[0]).save(folder / VARIANTS["thumbnail"][0])
    picks = np.linspace(0, len(pixels) - 1, min(SPRITES, len(pixels))).round().astype(int)
    Image.fromarray(np.concatenate(list(pixels[picks]), axis=1)).save(folder / VARIANTS["spritesheet"][0])
    with zipfile.ZipFile(folder / VARIANTS["frames"][0], "w") as archive:
        for index, frame in enumerate(pixels):
            png = io.BytesIO()
            Image.fromarray(frame).save(png, format="PNG")
            archive.writestr(f"frame_{index:04d}.png", png.getvalue())
    return sum(f.stat().st_size for f in folder.iterdir())


def _mp4(pixels: np.ndarray, path: Path, fps: int) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = pixels.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
