"""A video family's clip, declared once (`Family.clip`; None: the family makes images), and every
rule about a video's frames, derived from it in this one place:

- the Videos API's seconds ↔ frames (`frames_for`, `seconds_of`);
- a request's frames checked (`check_frames`) and its latent frames (`Clip.latent`);
- what a plan is sized by: the work bound, x the default clip's latent frames (`work_limit`);
  the activation reserve's clip, `max_batch` rows of the default clip at the largest size
  (`max_clip`); the longest clip that admits (`longest`), which the video VAE's decode peak is
  counted at.

A video job's deadline, `--video-timeout-s`, is with the other deadlines (`serving/limits.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.errors import InvalidRequest


@dataclass(frozen=True)
class Clip:
    frames: int  # the default clip's (Wan: 81, WanPipeline's)
    size: tuple[int, int]  # the default clip's (width, height)
    frame_multiple: int  # a clip's frames are 1 + a multiple of this (the VAE's temporal compression)
    max_frames: int | None = None  # the longest the denoiser takes (its positions), if it has a limit
    fps: int = 16  # the frame rate its videos are served at unless --video-fps says (Wan's 16)

    def latent(self, frames: int) -> int:
        """The latent frames of a clip of `frames` (1 + (frames - 1) / frame_multiple)."""
        return max(1, (frames - 1) // self.frame_multiple + 1)

    @property
    def latent_frames(self) -> int:
        """The default clip's latent frames: what the limits are sized by."""
        return self.latent(self.frames)

    def frames_of(self, latent_frames: int) -> int:
        return (latent_frames - 1) * self.frame_multiple + 1

    def max_clip(self, max_batch: int, max_pixels: int) -> int:
        """Rows x latent frames x pixels a step may hold of one video: `max_batch` rows of the
        default clip at the largest size, what the plan's activation reserve holds."""
        return max_batch * self.latent_frames * max_pixels

    def longest(self, max_batch: int) -> int:
        """The most frames `max_clip` admits (at the largest size, unguided: one row), within
        the denoiser's own bound."""
        frames = self.frames_of(max_batch * self.latent_frames)
        return frames if self.max_frames is None else min(frames, self.max_frames)


def work_limit(max_work: float, clip: Clip | None, explicit: bool) -> float:
    """`--max-work`: native-image steps; a video model's default is x its default clip's latent
    frames, so the default clip at the default steps is within it (an explicit value is kept)."""
    return max_work if clip is None or explicit else max_work * clip.latent_frames


def frames_for(seconds: str | int, fps: int) -> int:
    """The Videos API's `seconds` as frames: `seconds x fps + 1` (16 fps: "4" is 65 frames)."""
    text = str(seconds)
    if not text.isdigit() or int(text) < 1:
        raise InvalidRequest("seconds", f"must be a whole number of seconds ≥ 1, got {seconds!r}")
    return int(text) * fps + 1


def seconds_of(frames: int, fps: int) -> str:
    """A clip's length as the Video object says it."""
    return f"{(frames - 1) / fps:g}"


def check_frames(frames: int, clip: Clip | None) -> None:
    """InvalidRequest naming `num_frames` for frames this family cannot make."""
    if clip is None:
        raise InvalidRequest("num_frames", "this model makes images, not videos")
    every = clip.frame_multiple
    if frames < 1 or (frames - 1) % every:
        raise InvalidRequest(
            "num_frames", f"must be 1 more than a multiple of {every} (e.g. 81), got {frames}"
        )
    if clip.max_frames is not None and frames > clip.max_frames:
        message = f"must be at most {clip.max_frames} for this model, got {frames}"
        raise InvalidRequest("num_frames", message)
