"""One step of many requests: their calls (a call per expert whose rows are due), then each
request's guidance and its own scheduler's step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from server.engine import CallPlan, RowGroup
from server.engine.denoisers.blocks import DenoiserInputs
from server.pipeline.conditioning.edits import blend
from server.pipeline.conditioning.live_changes import CHANGES
from server.pipeline.families import Family
from server.pipeline.loading.deployment import Lane
from server.pipeline.steps.caching import cache_ask, hold, keep
from server.pipeline.steps.schedulers import predicted_clean
from server.pipeline.steps.state import RequestState, spans


def call_plan(states: Sequence[RequestState]) -> CallPlan:
    """This step's call: per request, its rows, adapters, step-cache ask and determinism.
    Rows with adapters run eagerly (compiled graphs never call the adapters' hooks)."""
    groups = tuple(RowGroup(s.rows, s.request.lora, cache_ask(s), s.request.deterministic) for s in states)
    return CallPlan(groups, compiled=not any(s.request.lora for s in states))


def expert_calls(
    states: Sequence[RequestState],
    lanes: Sequence[Lane],
    family: Family,
    stack: Callable[[Sequence[RequestState]], DenoiserInputs],
) -> tuple[list[list[RequestState]], dict[int, torch.Tensor]]:
    """The states by the expert their timestep takes (`Family.expert`; one for most families),
    and each state's prediction (by id): an expert's rows in one call through its lane, one
    expert after the other; each row's step cache kept."""
    for state in states:
        state.expert = family.expert(state.scheduler, state.timestep)
    by_expert = [[s for s in states if s.expert == k] for k in range(len(lanes))]
    outs: dict[int, torch.Tensor] = {}
    for lane, group in zip(lanes, by_expert, strict=True):
        if not group:
            continue
        with CHANGES.reading():
            result = lane.forward(stack(group), call_plan(group))
        for state, outcome, span in zip(group, result.outcomes, spans(group), strict=True):
            keep(state, outcome)
            hold(state, outcome)
            # an expert placed apart predicts on its own GPU; the scheduler steps on the latents'
            outs[id(state)] = result.out[span].to(state.latents.device)
    return by_expert, outs


def advance(state: RequestState, prediction: torch.Tensor, family: Family) -> tuple[int, torch.Tensor] | None:
    """Step `state` by its rows' `prediction`: classifier-free guidance, its scheduler's step,
    an inpainting's unmasked region back to the image. Returns (partial index, predicted clean
    latents) when a partial image is due at this step."""
    prediction = family.combine(prediction, state)  # guidance: the rows' predictions made one
    partial, state.preview = state.previews.get(state.index + 1), None
    scheduler = state.scheduler
    output = scheduler.step(prediction, state.timestep, state.latents, return_dict=True, **state.step_kwargs)
    due = None
    if partial is not None:
        due = partial, predicted_clean(scheduler, state.latents, prediction, output, state.timestep)
    # Into the other buffer: a multistep scheduler may keep the sample it stepped from for its next
    # step (UniPC's corrector, PNDM's PLMS), so the latents are never overwritten in place.
    if state.spare is None:
        state.spare = state.scope.rent(state.latents.shape, state.latents.dtype, state.latents.device)
    state.spare.copy_(output.prev_sample)
    state.latents, state.spare = state.spare, state.latents
    if state.inpainting is not None:  # the unmasked region back to the image
        blend(family, scheduler, state.latents, state.inpainting, state.next_timestep)
    state.index += 1
    if state.first_frame is not None and (state.done or family.still_every_step):  # as the pipeline ends
        family.hold_first_frame(state.latents, state.first_frame)
    return due
