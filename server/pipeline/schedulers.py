"""Per-request schedulers: diffusers schedulers keep state (step index, solver history), so
every request gets its own instance, built from the folder's scheduler config. Which names a
model accepts is its family's `schedulers`."""

from __future__ import annotations

from typing import Any

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
