"""The guidance of a model that denoises a video and its sound together (LTX-2), beyond the video's
classifier-free scale (`GenerationRequest.guidance_scale`). Every field left unset takes the
family's default, its pipeline's (`LTX2Pipeline.__call__`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from server.errors import InvalidRequest

MAX_SCALE = 100.0  # far past any useful scale: a bound on what a request may ask


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
            if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= top):
                raise InvalidRequest(
                    f"guidance.{f.name}", f"must be a number from 0 to {top:g}, got {value!r}"
                )

    def filled(self, defaults: AudioVideoGuidance) -> AudioVideoGuidance:
        """Every unset field from `defaults`."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return AudioVideoGuidance(**{k: getattr(defaults, k) if v is None else v for k, v in values.items()})
