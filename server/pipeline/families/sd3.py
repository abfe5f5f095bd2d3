"""Stable Diffusion 3 (MMDiT): a transformer denoiser over patches, two CLIP encoders whose
penultimate states are padded to the joint dimension and followed by T5's tokens (zeros when
the folder has no T5, as diffusers does), a pooled vector from both CLIPs, a flow-matching
schedule shifted by image size, and a VAE with a shift factor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import SD3Transformer2DModel
from diffusers.image_processor import VaeImageProcessor
from torch import nn

from server.engine.denoisers.dit import (
    T5_TOKENS,  # diffusers' max_sequence_length default: T5's, or its zeros'
)
from server.errors import ModelFolderError
from server.pipeline.families.base import Family, TextEmbeddings, other_width, penultimate_states
from server.pipeline.steps.schedulers import FLOW_FOLDER_SCHEDULERS
from server.requests.generation import GenerationRequest


class SD3(Family):
    name: ClassVar[str] = "sd3"
    pipeline_classes: ClassVar[tuple[str, ...]] = (
        "StableDiffusion3Pipeline",
        "StableDiffusion3Img2ImgPipeline",
        "StableDiffusion3InpaintPipeline",
    )
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = SD3Transformer2DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer", "tokenizer_2", "tokenizer_3")
    schedulers: ClassVar[tuple[str, ...]] = ("default",)  # flow matching: the folder's own
    folder_schedulers: ClassVar[tuple[str, ...]] = FLOW_FOLDER_SCHEDULERS
    step_caches: ClassVar[tuple[str, ...]] = ("off", "first_block")
    # the text's projection in and the output head (its modulation and projection), as Nunchaku
    # keeps them: under 1% of the weights (the latents' projection in is a convolution)
    keep_precise: ClassVar[tuple[str, ...]] = ("context_embedder", "norm_out", "proj_out")
    default_steps: ClassVar[int] = 28
    default_guidance: ClassVar[float] = 7.0
    controlnets: ClassVar[tuple[str, ...]] = ("SD3ControlNetModel",)
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        "sd3": {  # stabilityai/stable-diffusion-3-medium-diffusers, transformer/config.json
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 192,
        }
    }

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        (clip_l, clip_g), (tok_l, tok_g) = encoders[:2], tokenizers[:2]
        hidden_l, pooled_l = penultimate_states(clip_l, tok_l, prompts)
        hidden_g, pooled_g = penultimate_states(clip_g, tok_g, prompts)
        clip = torch.cat([hidden_l, hidden_g], dim=-1)  # [N, 77, dim_l + dim_g]
        joint = int(self.config.denoiser["joint_attention_dim"])
        if len(encoders) > 2:  # T5
            ids = tokenizers[2](
                prompts, padding="max_length", max_length=T5_TOKENS, truncation=True, return_tensors="pt"
            ).input_ids
            t5 = encoders[2](ids.to(clip.device))[0].to(clip.dtype)
        else:
            t5 = torch.zeros(len(prompts), T5_TOKENS, joint, dtype=clip.dtype, device=clip.device)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return TextEmbeddings(torch.cat([clip, t5], dim=-2), torch.cat([pooled_l, pooled_g], dim=-1))

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        return {"pooled_projections": pooled}

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)

    @property
    def _patch(self) -> int:
        return int(self.config.denoiser.get("patch_size", 2))

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * self._patch  # as StableDiffusion3Pipeline.check_inputs

    @property
    def max_size(self) -> int | None:
        patches = self.config.denoiser.get("pos_embed_max_size")  # the position embedding's grid
        return None if patches is None else int(patches) * self._patch * self.vae_scale_factor

    def set_timesteps(self, scheduler: Any, steps: int, device: torch.device, latent_shape: tuple) -> None:
        config, kwargs = scheduler.config, {}
        if config.get("use_dynamic_shifting"):  # shift the schedule by image size, as diffusers does
            tokens = (latent_shape[-2] // self._patch) * (latent_shape[-1] // self._patch)
            base, top = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
            low, high = config.get("base_shift", 0.5), config.get("max_shift", 1.16)
            slope = (high - low) / (top - base)
            kwargs["mu"] = tokens * slope + (low - slope * base)
        scheduler.set_timesteps(steps, device=device, **kwargs)

    def control_refusal(self, config: dict[str, Any]) -> str | None:
        if config.get("extra_conditioning_channels"):
            return "an SD3 ControlNet with extra conditioning channels (a mask's) is not supported yet"
        if not config.get("use_pos_embed", True):
            return "an SD3.5 ControlNet without a position embedding of its own (8B) is not supported yet"
        return other_width(config, self.config.denoiser)

    def control_image(
        self, net: nn.Module, image: Any, width: int, height: int, vae: nn.Module, generator: torch.Generator
    ) -> torch.Tensor:
        """StableDiffusion3ControlNetPipeline's: RGB in [-1, 1], encoded by the VAE, scaled (not
        shifted for InstantX's nets, those with a zero pooled projection). It samples the VAE's
        posterior from torch's global generator, unseeded; we take its mode, so a seed draws one
        image (the same within a trained VAE's narrow posterior)."""
        pixels = VaeImageProcessor().preprocess(image, height=height, width=width)
        device = next(vae.parameters()).device
        latents = vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode()
        if net.config.force_zeros_for_pooled_projection:
            return latents * self.config.vae["scaling_factor"]
        return self.scale_latents(latents)

    def control_residuals(self, net: nn.Module, inputs: Any, image: torch.Tensor) -> dict[str, Any]:
        pooled, config = inputs.conditioning["pooled_projections"], net.config
        if config.force_zeros_for_pooled_projection:  # InstantX's nets, as the pipeline feeds them
            pooled = torch.zeros_like(pooled)
        (samples,) = net(
            hidden_states=inputs.sample,
            controlnet_cond=image,
            conditioning_scale=1.0,
            encoder_hidden_states=inputs.context if config.joint_attention_dim is not None else None,
            pooled_projections=pooled,
            timestep=inputs.timestep,
            return_dict=False,
        )
        return {"block_controlnet_hidden_states": tuple(samples)}

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        index = self.config.index
        present = [
            n for n in (*self.text_encoders, *self.tokenizers) if index.get(n) and index[n][0] is not None
        ]
        if len(encoders) < 2 or len(present) % 2:
            raise ModelFolderError(
                "an SD3 folder needs text_encoder and text_encoder_2 with their tokenizers, and "
                f"text_encoder_3 (T5) with tokenizer_3 or neither; this one has {', '.join(present)}"
            )

    def edit_begin(self, steps: int, strength: float) -> int:
        return int(max(steps - steps * strength, 0))  # SD3's get_timesteps floors the steps skipped

    def init_noise_sigma(self, scheduler: Any) -> float:
        return 1.0  # flow matching starts from pure noise

    def noised(
        self, scheduler: Any, clean: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        return scheduler.scale_noise(clean, t, noise)  # flow matching: (1 - σ) x0 + σ noise

    def model_input(self, scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return latents
