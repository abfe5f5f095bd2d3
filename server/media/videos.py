"""A finished video's content, as `/v1/videos/{id}/content` serves it: an H.264 MP4 (PyAV's
FFmpeg, libx264, yuv420p: lossy, as every MP4 a browser plays), its frames as PNGs in a ZIP (a
lossless variant, so a client can check exact pixels), its first frame as the thumbnail, and a
spritesheet (up to 8 frames evenly spaced, side by side). Written off the step loop.

A video given a `Soundtrack` (a vocoder's float samples) has sound: the MP4 gets an AAC stream
(FFmpeg's native encoder, at the track's own rate, mono or stereo) beside the H.264 one, both
starting at 0 (the MP4's edit list hides the encoder's priming), and an "audio" variant keeps
the track as generated, unclipped and lossless: a 32-bit IEEE float WAV (`read_wav` reads it
back). A video without one has exactly the files it had before, and no audio stream."""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from server.media.images import to_uint8

if TYPE_CHECKING:
    from collections.abc import Iterator

    from av.container import OutputContainer
    from av.packet import Packet

VARIANTS = {  # variant → (file, media type)
    "video": ("video.mp4", "video/mp4"),
    "thumbnail": ("thumbnail.png", "image/png"),
    "spritesheet": ("spritesheet.png", "image/png"),
    "frames": ("frames.zip", "application/zip"),
    "audio": ("audio.wav", "audio/wav"),  # only a video with a soundtrack has it
}
SPRITES = 8
WAVE_FORMAT_IEEE_FLOAT = 3


@dataclass(frozen=True, eq=False)  # eq=False: == on arrays is elementwise, not a bool
class Soundtrack:
    """A video's sound: `samples` [channels, n] (1 or 2 channels) in about [-1, 1], as a vocoder
    gives it (kept float32), `rate` samples per second."""

    samples: np.ndarray
    rate: int

    def __post_init__(self) -> None:
        samples = np.asarray(self.samples, dtype=np.float32)
        if samples.ndim != 2 or samples.shape[0] not in (1, 2) or samples.shape[1] == 0:
            raise ValueError(f"a soundtrack is [channels, n] with 1 or 2 channels, got {samples.shape}")
        if int(self.rate) != self.rate or self.rate <= 0:
            raise ValueError(f"a soundtrack's rate is a positive whole number of Hz, got {self.rate!r}")
        object.__setattr__(self, "samples", samples)
        object.__setattr__(self, "rate", int(self.rate))


@dataclass(frozen=True, eq=False)
class Voiced:
    """A finished video with its sound, as a model that makes sound returns a video."""

    frames: np.ndarray  # [F, H, W, 3] in [0, 1]
    sound: Soundtrack


def video_files(frames: np.ndarray, fps: int, audio: Soundtrack | None = None) -> dict[str, bytes]:
    """Every variant of `frames` ([F, H, W, 3] in [0, 1]), file name → bytes; with `audio`, the
    MP4 has it as an AAC stream and "audio.wav" holds it as generated."""
    pixels = to_uint8(np.clip(frames, 0, 1))  # [F, H, W, 3], rounded as diffusers' `numpy_to_pil`
    picks = np.linspace(0, len(pixels) - 1, min(SPRITES, len(pixels))).round().astype(int)
    frames_zip = io.BytesIO()
    with zipfile.ZipFile(frames_zip, "w") as archive:
        for index, frame in enumerate(pixels):
            archive.writestr(f"frame_{index:04d}.png", _png(frame))
    files = {
        VARIANTS["video"][0]: _mp4(pixels, fps, audio),
        VARIANTS["thumbnail"][0]: _png(pixels[0]),
        VARIANTS["spritesheet"][0]: _png(np.concatenate(list(pixels[picks]), axis=1)),
        VARIANTS["frames"][0]: frames_zip.getvalue(),
    }
    if audio is not None:
        files[VARIANTS["audio"][0]] = wav(audio)
    return files


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _mp4(pixels: np.ndarray, fps: int, audio: Soundtrack | None = None) -> bytes:
    import av  # PyAV (36 MB, FFmpeg inside) where a video is encoded: image-only hosts go without

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = pixels.shape[1:3]
        stream.pix_fmt = "yuv420p"
        # every stream is added before the first packet: the header (which lists them) goes then
        sound = _aac(container, audio) if audio is not None else iter(())
        for frame in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        for packets in sound:  # the muxer interleaves them with the video's by time
            container.mux(packets)
    return out.getvalue()


def _aac(container: OutputContainer, audio: Soundtrack) -> Iterator[list[Packet]]:
    """`audio` as an AAC stream of `container`, added now, its packets encoded as they are asked
    for: FFmpeg's native encoder (every build has it), planar float, at the track's own rate (it
    takes the 13 MPEG-4 rates, 7350 to 96000 Hz, 16 and 24 kHz among them: nothing is
    resampled), clipped to [-1, 1] as AAC expects."""
    import av

    rates = av.Codec("aac", "w").audio_rates
    if audio.rate not in rates:  # FFmpeg would refuse to open the encoder: say why here
        raise ValueError(f"AAC takes no soundtrack at {audio.rate} Hz, only at {sorted(rates)} Hz")
    channels, count = audio.samples.shape
    layout = "stereo" if channels == 2 else "mono"
    stream = container.add_stream("aac", rate=audio.rate, layout=layout, format="fltp")
    stream.codec_context.open()  # opened now for its frame size (1024 samples for AAC)
    size = stream.codec_context.frame_size
    samples = np.clip(audio.samples, -1, 1)

    def packets() -> Iterator[list[Packet]]:
        for start in range(0, count, size):  # the last frame may be short: the encoder pads it
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(samples[:, start : start + size]), format="fltp", layout=layout
            )
            frame.sample_rate, frame.pts = audio.rate, start  # in samples, from 0: in step with the video
            yield stream.encode(frame)
        yield stream.encode()  # flushed: the frames the encoder held back

    return packets()


def wav(audio: Soundtrack) -> bytes:
    """`audio` as a WAV of 32-bit IEEE float samples, little-endian, channels interleaved: the
    exact samples, unclipped. `wave` writes PCM only, so the header is written here: RIFF, an
    18-byte "fmt " (a non-PCM format carries cbSize), and the "fact" chunk (the sample frames per
    channel) that every non-PCM WAV is to have."""
    channels, count = audio.samples.shape
    data = np.ascontiguousarray(audio.samples.T, dtype="<f4").tobytes()  # frame by frame: L R L R …
    fmt = struct.pack(
        "<HHIIHHH",
        WAVE_FORMAT_IEEE_FLOAT,
        channels,
        audio.rate,
        audio.rate * channels * 4,  # bytes per second
        channels * 4,  # block align: the bytes of one frame
        32,  # bits per sample
        0,  # cbSize: no extension
    )
    chunks = [
        b"fmt " + struct.pack("<I", len(fmt)) + fmt,
        b"fact" + struct.pack("<II", 4, count),
        b"data" + struct.pack("<I", len(data)) + data,  # whole floats: even, so no pad byte
    ]
    body = b"WAVE" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A float WAV as `wav` writes it: samples [channels, n] float32 and the rate. Chunks it does
    not need (fact, LIST, …) are skipped, as the format asks a reader to."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF WAVE file")
    chunks, at = {}, 12
    while at + 8 <= len(data):
        name, size = data[at : at + 4], struct.unpack_from("<I", data, at + 4)[0]
        chunks.setdefault(name, data[at + 8 : at + 8 + size])
        at += 8 + size + size % 2  # a chunk of odd size is followed by a pad byte
    if b"fmt " not in chunks or b"data" not in chunks:
        raise ValueError("a WAV without its fmt or data chunk")
    form, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", chunks[b"fmt "])
    if (form, bits) != (WAVE_FORMAT_IEEE_FLOAT, 32):
        raise ValueError(f"not a 32-bit float WAV (format {form}, {bits} bits)")
    samples = np.frombuffer(chunks[b"data"], dtype="<f4")
    return np.ascontiguousarray(samples.reshape(-1, channels).T, dtype=np.float32), rate
