"""What the flow-matching transformers over 2x2-packed latents share (FLUX.1, FLUX.2, Qwen-Image):
latents drawn [1, C, h, w] and packed by the engine's spec, a schedule of sigmas from 1 to 1/steps
shifted by `mu` from the image's token count, pure noise at the start, and true CFG: diffusers'
`true_cfg_scale` with a negative prompt, a second row."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from server.pipeline.families.base import Family
from server.pipeline.steps.schedulers import FLOW_FOLDER_SCHEDULERS
from server.requests.generation import GenerationRequest


def shift_mu(config: Any, tokens: int, max_shift: float = 1.15) -> float:
    """diffusers' `calculate_shift`: `mu` by the image's token count, from the scheduler's config."""
    base, top = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    low, high = config.get("base_shift", 0.5), config.get("max_shift", max_shift)
    slope = (high - low) / (top - base)
    return tokens * slope + (low - slope * base)


class PackedFlow(Family):
    """A flow-matching transformer over 2x2 patches of the latents (packed by the engine's spec)."""

    schedulers: ClassVar[tuple[str, ...]] = ("default",)  # flow matching: the folder's own
    folder_schedulers: ClassVar[tuple[str, ...]] = FLOW_FOLDER_SCHEDULERS  # timesteps set by sigmas and mu
    takes_true_cfg: ClassVar[bool] = True
    step_caches: ClassVar[tuple[str, ...]] = ("off", "first_block")  # the spec's cache boundary
    native_latent: ClassVar[int] = 128  # the pipelines' default_sample_size: 1024 px

    def rows(self, request: GenerationRequest) -> int:
        """One row, or two for true CFG (diffusers: true_cfg_scale > 1 with a negative prompt)."""
        return 2 if request.true_cfg_scale > 1 and request.negative_prompt is not None else 1

    lone_rows = 1  # guidance is embedded, distilled or absent: true CFG is the exception

    def cfg_scale(self, request: GenerationRequest, expert: int = 0) -> float:
        return request.true_cfg_scale

    @property
    def latent_channels(self) -> int:
        return int(self.config.vae.get("latent_channels", int(self.config.denoiser["in_channels"]) // 4))

    @property
    def inpainting_channels(self) -> int:
        return 0  # in_channels counts packed features (4 per latent channel), not extra inputs

    @property
    def native_size(self) -> int:
        return self.native_latent * self.vae_scale_factor  # the configs have no sample_size

    @property
    def size_multiple(self) -> int:
        return 2 * self.vae_scale_factor  # 2x2 packing (diffusers resizes with a warning; we refuse)

    def set_timesteps(self, scheduler: Any, steps: int, device: torch.device, latent_shape: tuple) -> None:
        """The pipelines' schedule: sigmas from 1 to 1/steps, shifted by `mu` from the token count."""
        tokens = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
        mu = shift_mu(scheduler.config, tokens)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=device, mu=mu)

    def edit_begin(self, steps: int, strength: float) -> int:
        return int(max(steps - steps * strength, 0))  # the img2img pipelines' get_timesteps, as SD3's

    def init_noise_sigma(self, scheduler: Any) -> float:
        return 1.0  # flow matching starts from pure noise

    def noised(
        self, scheduler: Any, clean: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        return scheduler.scale_noise(clean, t, noise)

    def model_input(self, scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return latents
