"""Per-request schedulers: diffusers schedulers keep state (step index, solver history), so
every request gets its own instance, built from the folder's scheduler config. Which names a
model accepts is its family's `schedulers`; which classes its folder may ship, its
`folder_schedulers`."""

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

from server.errors import ModelFolderError

SCHEDULERS: dict[str, type] = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_a": EulerAncestralDiscreteScheduler,
    "dpmpp_2m": DPMSolverMultistepScheduler,  # DPM-Solver++ (2M), diffusers' default algorithm
}
SCHEDULER_NAMES = ("default", *SCHEDULERS)

# The classes a folder's own scheduler may be, by kind of model: each is stepped per request as
# its diffusers pipeline steps it, as tests/test_schedulers.py's table shows (a row each). A
# folder that ships another is refused at load (`check_folder_scheduler`), never served otherwise.
DDPM_FOLDER_SCHEDULERS = (
    "PNDMScheduler",
    "DDIMScheduler",
    "DDPMScheduler",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "DPMSolverSinglestepScheduler",
    "UniPCMultistepScheduler",
    "DEISMultistepScheduler",
    "HeunDiscreteScheduler",
    "KDPM2DiscreteScheduler",
    "KDPM2AncestralDiscreteScheduler",
    "SASolverScheduler",
    "EDMEulerScheduler",
    "LCMScheduler",
    "TCDScheduler",
)
FLOW_FOLDER_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)


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


def check_folder_scheduler(class_name: str, accepted: tuple[str, ...], family: str, where: str) -> None:
    """Refuse a folder's scheduler class its family does not step as its pipeline does."""
    if class_name not in accepted:
        raise ModelFolderError(
            f"{where} names {class_name}, a scheduler diffshard does not step per request for {family} "
            f"folders; it steps {', '.join(accepted)}. Set model_index.json's scheduler and "
            "scheduler/scheduler_config.json's _class_name to one of them (the config's other keys "
            "can stay: each class takes the ones it knows)"
        )


def predicted_clean(
    scheduler: Any, latents: torch.Tensor, prediction: torch.Tensor, output: Any, timestep: torch.Tensor
) -> torch.Tensor:
    """The model's estimate of the finished latents at the step just taken from `latents` at
    `timestep`: what a partial image shows. Most schedulers return it (DDIM, DDPM, the Euler and
    Heun ones; LCM as `denoised`); the multistep solvers that predict it (DPM-Solver++, UniPC's
    predict_x0) keep it as their last model output; flow matching (SD3, FLUX, Wan's UniPC
    otherwise) predicts a velocity: x0 = x_t - sigma v; the others (PNDM, TCD, DEIS) keep only
    the noise schedule: x0 from alpha-bar at t and what the model predicts."""
    for name in ("pred_original_sample", "denoised"):
        if (clean := getattr(output, name, None)) is not None:
            return clean
    config = scheduler.config
    if getattr(scheduler, "model_outputs", None) and (
        config.get("predict_x0") or "dpmsolver++" in config.get("algorithm_type", "")
    ):
        return scheduler.model_outputs[-1]
    if config.get("prediction_type") == "flow_prediction" or not hasattr(scheduler, "alphas_cumprod"):
        sigma = scheduler.sigmas[scheduler.step_index - 1]  # the step just taken
        return latents - sigma * prediction
    alpha = scheduler.alphas_cumprod[int(timestep)].to(latents.device, latents.dtype)
    signal, noise = alpha.sqrt(), (1 - alpha).sqrt()
    kind = config.get("prediction_type", "epsilon")
    if kind == "v_prediction":
        return signal * latents - noise * prediction
    if kind == "sample":
        return prediction
    return (latents - noise * prediction) / signal
