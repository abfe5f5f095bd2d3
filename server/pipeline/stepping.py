"""After a step's call: one request's guidance and its own scheduler's step."""

from __future__ import annotations

import torch

from server.pipeline.edits import blend
from server.pipeline.families import Family
from server.pipeline.schedulers import predicted_clean
from server.pipeline.state import RequestState


def advance(state: RequestState, prediction: torch.Tensor, family: Family) -> tuple[int, torch.Tensor] | None:
    """Step `state` by its rows' `prediction`: classifier-free guidance, its scheduler's step,
    an inpainting's unmasked region back to the image. Returns (partial index, predicted clean
    latents) when a partial image is due at this step."""
    if state.rows == 2:  # classifier-free guidance: negative row, then prompt row
        prediction = family.guide(*prediction.chunk(2), state.request)
    partial, early, state.preview = state.previews.get(state.index + 1), None, None
    scheduler = state.scheduler
    if partial is not None and hasattr(scheduler, "convert_model_output"):  # DPM-Solver
        if scheduler.step_index is None:  # its first step: nothing to convert with yet
            partial = None
        else:
            early = scheduler.convert_model_output(prediction, sample=state.latents)
    output = scheduler.step(prediction, state.timestep, state.latents, return_dict=True, **state.step_kwargs)
    due = None
    if partial is not None:
        due = partial, predicted_clean(scheduler, state.latents, prediction, output, early)
    state.latents.copy_(output.prev_sample)
    if state.inpainting is not None:  # the unmasked region back to the image
        blend(family, scheduler, state.latents, state.inpainting, state.next_timestep)
    state.index += 1
    return due
