"""Per-request schedulers: diffusers schedulers keep state (step index, solver history), so
every request gets its own instance, built from the folder's scheduler config. Which names a
model accepts is its family's `schedulers`."""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)

SCHEDULERS: dict[str, type] = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_a": EulerAncestralDiscreteScheduler,
    "dpmpp_2m": DPMSolverMultistepScheduler,  # DPM-Solver++ (2M), diffusers' default algorithm
}
SCHEDULER_NAMES = ("default", *SCHEDULERS)


def make_scheduler(folder_scheduler: Any, name: str = "default") -> Any:
    """A fresh scheduler `name` configured like the folder's own (betas, prediction type, spacing).

    "default" is the folder's own class. Keys one class lacks are ignored by `from_config`,
    so e.g. a zero-terminal-SNR DDIM config gives a zero-terminal-SNR Euler.
    """
    if name == "default":
        cls = type(folder_scheduler)
    elif name in SCHEDULERS:
        cls = SCHEDULERS[name]
    else:
        raise ValueError(f"scheduler must be one of {', '.join(SCHEDULER_NAMES)}, got {name!r}")
    return cls.from_config(folder_scheduler.config)


@cache
def _accepts(scheduler_class: type, argument: str) -> bool:
    return argument in inspect.signature(scheduler_class.step).parameters


def step_kwargs(scheduler_class: type, generator: torch.Generator) -> dict[str, Any]:
    """What diffusers' prepare_extra_step_kwargs passes: eta=0 (DDIM) and the request's generator."""
    kwargs: dict[str, Any] = {}
    if _accepts(scheduler_class, "eta"):
        kwargs["eta"] = 0.0
    if _accepts(scheduler_class, "generator"):
        kwargs["generator"] = generator
    return kwargs


def predicted_clean(
    scheduler: Any, latents: torch.Tensor, prediction: torch.Tensor, output: Any
) -> torch.Tensor:
    """The model's estimate of the finished latents at the step just taken from `latents`: what a
    partial image shows. DDIM and the Euler schedulers return it; the multistep solvers that
    predict it (DPM-Solver++, UniPC's predict_x0) keep it as their last model output; flow
    matching (SD3, Wan's UniPC otherwise) predicts a velocity: x0 = x_t - sigma * v."""
    if getattr(output, "pred_original_sample", None) is not None:
        return output.pred_original_sample
    config = scheduler.config
    if getattr(scheduler, "model_outputs", None) and (
        config.get("predict_x0") or "dpmsolver++" in config.get("algorithm_type", "")
    ):
        return scheduler.model_outputs[-1]
    sigma = scheduler.sigmas[scheduler.step_index - 1]  # the step just taken
    return latents - sigma * prediction
