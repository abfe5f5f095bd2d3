"""The guidance of a model that denoises a video and its sound together (LTX-2), beyond the video's
classifier-free scale (`GenerationRequest.guidance_scale`). Every field left unset takes the
family's default, its pipeline's (`LTX2Pipeline.__call__`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

from server.errors import InvalidRequest

MAX_SCALE = 100.0  # far past any useful scale: a bound on what a request may ask
MAX_BLOCKS = 256  # more blocks than any published model has


@dataclass(frozen=True)
class AudioVideoGuidance:
    audio_scale: float | None = None  # the audio's classifier-free scale
    stg_scale: float | None = None  # spatio-temporal guidance: chosen blocks' self-attention skipped
    audio_stg_scale: float | None = None
    modality_scale: float | None = None  # modality isolation: no audio↔video attention
    audio_modality_scale: float | None = None
    rescale: float | None = None  # guidance rescale (0: off), of the video's prediction
    audio_rescale: float | None = None
    stg_blocks: tuple[int, ...] | None = None  # the blocks spatio-temporal guidance perturbs

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "stg_blocks":
                continue
            top = 1.0 if f.name.endswith("rescale") else MAX_SCALE
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and 0 <= value <= top):
                raise InvalidRequest(
                    f"guidance.{f.name}", f"must be a number from 0 to {top:g}, got {value!r}"
                )

    def filled(self, defaults: AudioVideoGuidance) -> AudioVideoGuidance:
        """Every unset field from `defaults`."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return AudioVideoGuidance(**{k: getattr(defaults, k) if v is None else v for k, v in values.items()})


def parse_guidance(value: object) -> AudioVideoGuidance:
    """A request's `guidance`: an object of AudioVideoGuidance's fields (or its JSON text, as a
    multipart form sends it), every value checked and named."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        raise InvalidRequest("guidance", f"must be an object of {', '.join(NAMES)}")
    if unknown := sorted(set(value) - set(NAMES)):
        raise InvalidRequest(
            f"guidance.{unknown[0]}", f"is not a guidance setting (those are {', '.join(NAMES)})"
        )
    blocks = value.get("stg_blocks")
    if blocks is not None:
        if not (
            isinstance(blocks, list) and len(blocks) <= MAX_BLOCKS and all(type(b) is int for b in blocks)
        ):
            raise InvalidRequest(
                "guidance.stg_blocks", f"must be a list of at most {MAX_BLOCKS} block numbers"
            )
        value = {**value, "stg_blocks": tuple(blocks)}
    return AudioVideoGuidance(**value)


NAMES = tuple(f.name for f in fields(AudioVideoGuidance))
