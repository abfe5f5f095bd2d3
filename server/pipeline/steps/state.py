"""One request's state between steps, and which states can share a denoiser call."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from server.engine.denoisers.blocks import (
    TARGET_TIMESTEP,
    TEXT_ALIGNED,
    TEXT_BUCKET,
    TEXT_MASK,
    DenoiserInputs,
)
from server.engine.runtime.pool import PoolScope
from server.pipeline.conditioning.controlnets import RowControl
from server.pipeline.conditioning.edits import Inpainting
from server.pipeline.loading.vae_tiling import images_per_call
from server.requests.generation import GenerationRequest


@dataclass
class RowCache:
    """What one request's rows keep between steps (buffers its scope rents, so they go back to the
    pool when it ends) and its counts."""

    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # the walk's features, [rows, ...] each
    refreshed_at: int | None = None  # the step of its last refresh
    expert: int = 0  # the expert whose features it keeps (`Family.experts`' index)
    refreshed: int = 0  # steps it ran whole
    reused: int = 0  # steps it took the kept features
    last: str | None = None  # this step's outcome, "refreshed" or "reused" (None: not cached)

    @property
    def nbytes(self) -> int:
        # a snapshot first (one C call): another thread (stats) reads while the loop inserts
        return sum(t.numel() * t.element_size() for t in tuple(self.kept.values()))


@dataclass
class RequestState:
    """Everything one request carries between steps; `close()` returns what it rented."""

    request: GenerationRequest  # resolved: every field set
    scheduler: Any  # its own instance: diffusers schedulers keep a step index and history
    generator: torch.Generator
    latents: torch.Tensor  # [1, C, h, w], LATENT_DTYPE, a new buffer every step (`spare`)
    context: torch.Tensor  # [rows, tokens, dim]: negative row first when guided
    extras: dict[str, torch.Tensor]  # the family's other per-row conditioning, [rows, ...] each
    scope: PoolScope
    index: int = 0  # steps taken
    begin: int = 0  # timesteps an edit skips (its strength): it starts at timesteps[begin]
    inpainting: Inpainting | None = None  # an inpainting edit's image latents, noise and mask
    conditioning: torch.Tensor | None = None  # an inpainting denoiser's mask and masked image [1, 5, h, w]
    first_frame: torch.Tensor | None = None  # [1, C, 1, h, w] pasted over the first latent frame
    image: torch.Tensor | None = None  # [H, W, 3] float in [0, 1] once decoded (rented)
    sound: torch.Tensor | None = None  # [channels, samples] float32 once decoded (a model with sound)
    closed: bool = False  # its buffers went back to the pool: it must not be stepped or decoded
    step_kwargs: dict[str, Any] = field(default_factory=dict)  # what scheduler.step takes beyond the sample
    preview: tuple[int, torch.Tensor] | None = None  # (partial index, [H, W, 3] image) not yet taken
    cache: RowCache = field(default_factory=RowCache)  # what step caching keeps (steps/caching.py)
    layout: tuple[Any, ...] = ()  # what its conditioning's positions depend on (an edit's image sizes)
    expert: int = 0  # the denoiser its rows ran at the last step (`Family.experts`' index)
    controls: tuple[RowControl, ...] = ()  # its ControlNets and their images (conditioning/controlnets.py)
    spare: torch.Tensor | None = None  # the latents' other buffer: a step writes there, then they swap
    # of a masked context (TEXT_MASK): the columns its rows use, read once as it starts
    text_columns: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        mask = self.extras.get(TEXT_MASK)
        if mask is not None and not (mask.is_meta or is_fake(mask)):  # else every column (not run)
            self.text_columns = int(mask.to(torch.bool).sum(dim=1).max())

    @property
    def previews(self) -> dict[int, int]:
        """Steps taken → partial image index: `partial_images` previews at evenly spaced steps
        before the last (fewer when there are too few steps)."""
        k, steps = self.request.partial_images, self.steps
        at = {round((i + 1) * steps / (k + 1)) for i in range(k)}
        return {step: index for index, step in enumerate(sorted(s for s in at if 0 < s < steps))}

    @property
    def rows(self) -> int:
        return self.context.shape[0]

    @property
    def steps(self) -> int:
        return len(self.scheduler.timesteps) - self.begin

    @property
    def done(self) -> bool:
        return self.index >= self.steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.scheduler.timesteps[self.begin + self.index]

    @property
    def next_timestep(self) -> torch.Tensor | None:
        """The timestep after this step's, None at the last step."""
        return None if self.index + 1 >= self.steps else self.scheduler.timesteps[self.begin + self.index + 1]

    @property
    def group(self) -> tuple[Any, ...]:
        """States with equal groups can share one denoiser call and one VAE decode."""
        extras = tuple((name, *value.shape[1:]) for name, value in sorted(self.extras.items()))
        return (*self.latents.shape[1:], *self.context.shape[1:], extras, self.layout)

    def frames_last(self, image: torch.Tensor) -> torch.Tensor:
        """[H, W, 3] (a video's [F, H, W, 3]), as output_type="np", from one VAE output [3, H, W]
        (a video model's [3, F, H, W]: an image of one is its one frame, a partial image's too)."""
        one = self.request.frames is None and image.dim() == 4
        image = (image[:, 0] if one else image).movedim(0, -1)
        if self.request.crop is not None:  # the output's box in the canvas it was made at
            left, top, right, bottom = self.request.crop
            image = image[..., top:bottom, left:right, :]
        return image

    def close(self) -> None:
        """End the request (finished, failed or cancelled); safe to call more than once."""
        self.closed = True
        self.scope.close()


def group_states(states: Sequence[RequestState]) -> list[list[RequestState]]:
    """States in groups that can share a denoiser call and a VAE decode, in first-seen order."""
    groups: dict[tuple[Any, ...], list[RequestState]] = {}
    for state in states:
        groups.setdefault(state.group, []).append(state)
    return list(groups.values())


def check_group(states: Sequence[RequestState]) -> None:
    if len({s.group for s in states}) > 1:
        raise ValueError(
            "requests of different sizes cannot share a denoiser or VAE call; group them by `group`"
        )


def per_call(states: Sequence[RequestState]) -> int:
    """How many images (or videos) of this (one) size one VAE call decodes."""
    request = states[0].request if states else None
    return 1 if request is None else images_per_call(request.width, request.height, request.frames)


def spans(states: Sequence[RequestState]) -> Iterable[slice]:
    """Each state's rows in the batch the states make, in order."""
    start = 0
    for state in states:
        yield slice(start, start + state.rows)
        start += state.rows


def stack_inputs(
    states: Sequence[RequestState], batch: PoolScope, family: Any, dtype: torch.dtype, device: torch.device
) -> DenoiserInputs:
    """The denoiser's inputs for every state's rows, in buffers `batch` rents: [rows, C, h, w]
    samples, [rows] timesteps, [rows, T, D] context, the family's extras. Where a video keeps its
    first frame still (Wan 2.2 TI2V's image-to-video), a timestep per row and latent frame, the
    still frame's 0, and its latents pasted there (WanImageToVideoPipeline's expand_timesteps)."""
    first, rows = states[0], sum(s.rows for s in states)
    columns = text_columns(states)
    channels = first.latents.shape[1]
    extra = 0 if first.conditioning is None else first.conditioning.shape[1]  # inpainting UNets'
    sample = batch.rent((rows, channels + extra, *first.latents.shape[2:]), dtype, device)
    still = any(s.first_frame is not None for s in states)
    timesteps = batch.rent(
        (rows, family.still_columns(first.latents.shape)) if still else (rows,), torch.float32, device
    )
    context = batch.rent((rows, columns, *first.context.shape[2:]), dtype, device)
    shapes = {
        name: (rows, columns, *v.shape[2:]) if name in TEXT_ALIGNED else (rows, *v.shape[1:])
        for name, v in first.extras.items()
    }
    extras = {name: batch.rent(shapes[name], v.dtype, device) for name, v in first.extras.items()}
    if family.flow_map:  # where each row's step jumps to: the next timestep, 0 at the last
        extras[TARGET_TIMESTEP] = batch.rent((rows,), torch.float32, device)
    for state, span in zip(states, spans(states), strict=True):
        sample[span, :channels] = family.model_input(state.scheduler, state.latents, state.timestep)
        if extra:  # an inpainting UNet's mask and masked image, beside the scaled latents
            sample[span, channels:] = state.conditioning
        timesteps[span] = state.timestep
        if family.flow_map:
            target = state.next_timestep
            extras[TARGET_TIMESTEP][span] = 0.0 if target is None else target
        if state.first_frame is not None:
            family.hold_first_frame(sample[span, :channels], state.first_frame, timesteps[span])
        context[span] = state.context[:, :columns]
        for name in state.extras:
            value = extras[name]
            value[span] = state.extras[name][:, :columns] if name in TEXT_ALIGNED else state.extras[name]
    return DenoiserInputs(sample, timesteps, context, family.model_kwargs(extras))


def text_columns(states: Sequence[RequestState]) -> int:
    """A call's text columns: where every state's context is masked, those its longest prompt
    uses rounded up to TEXT_BUCKET (the rest is padding each row masks), else all."""
    width, used = states[0].context.shape[1], [s.text_columns for s in states]
    if any(n is None for n in used):
        return width
    return min(width, -(-max(used) // TEXT_BUCKET) * TEXT_BUCKET)
