"""SDXL: two CLIP encoders side by side, a pooled prompt vector and six size/crop ids as extra
conditioning (`added_cond_kwargs`), zeros for an unset negative prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from server.errors import ModelFolderError
from server.pipeline.families.base import Family, TextEmbeddings, penultimate_states
from server.requests.generation import GenerationRequest


class SDXL(Family):
    name: ClassVar[str] = "sdxl"
    pipeline_classes: ClassVar[tuple[str, ...]] = (
        "StableDiffusionXLPipeline",
        "StableDiffusionXLImg2ImgPipeline",
        "StableDiffusionXLInpaintPipeline",
    )
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer", "tokenizer_2")
    default_guidance: ClassVar[float] = 5.0
    controlnets: ClassVar[tuple[str, ...]] = ("ControlNetModel",)
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        "sdxl": {
            "sample_size": 128,
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            "block_out_channels": (320, 640, 1280),
            "transformer_layers_per_block": (1, 2, 10),
            "cross_attention_dim": 2048,
            "attention_head_dim": (5, 10, 20),
            "use_linear_projection": True,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816,
        }
    }

    @property
    def zero_unset_negative(self) -> bool:
        return bool(self.config.index.get("force_zeros_for_empty_prompt", True))

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        contexts, pooled = [], None
        for tokenizer, encoder in zip(tokenizers, encoders, strict=True):
            hidden, first = penultimate_states(encoder, tokenizer, prompts)
            if pooled is None and first.ndim == 2:  # CLIPTextModelWithProjection's text_embeds
                pooled = first
            contexts.append(hidden)
        return TextEmbeddings(torch.cat(contexts, dim=-1), pooled)

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        size = (request.height, request.width)  # original size, crop top-left (0, 0), target size
        time_ids = torch.tensor([*size, 0, 0, *size], dtype=pooled.dtype, device=pooled.device)
        return {"text_embeds": pooled, "time_ids": time_ids.expand(pooled.shape[0], 6)}

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"added_cond_kwargs": extras}

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._latent_stats(latents)  # VAEs with per-channel normalised latents
        if mean is None:
            return super().unscale_latents(latents)
        return latents * std / self.config.vae["scaling_factor"] + mean

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """As StableDiffusionXLImg2ImgPipeline encodes (its inpainting pipeline ignores
        latents_mean/std when encoding: a mismatch with its own decoding not copied here)."""
        mean, std = self._latent_stats(latents)
        if mean is None:
            return super().scale_latents(latents)
        return (latents - mean) * self.config.vae["scaling_factor"] / std

    def _latent_stats(self, latents: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The VAE's per-channel latent mean and std, where it has them ([1, C, 1, 1] each)."""
        vae = self.config.vae
        mean, std = vae.get("latents_mean"), vae.get("latents_std")
        if mean is None or std is None:
            return None, None
        shape = (1, -1, 1, 1)
        return (
            torch.tensor(mean, dtype=latents.dtype, device=latents.device).view(shape),
            torch.tensor(std, dtype=latents.dtype, device=latents.device).view(shape),
        )

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        """The added embedding must take the pooled text plus 6 size ids, as diffusers checks."""
        pooled = getattr(encoders[-1].config, "projection_dim", None)
        if len(encoders) != 2 or pooled is None:
            raise ModelFolderError(
                "an SDXL folder needs text_encoder and text_encoder_2, the second with a projection"
            )
        given = self.config.denoiser["addition_time_embed_dim"] * 6 + pooled
        expected = denoiser.add_embedding.linear_1.in_features
        if given != expected:
            raise ModelFolderError(
                f"the UNet's added embedding takes {expected} features but the text encoder's pooled "
                f"projection ({pooled}) and 6 time ids make {given}: the folder's configs disagree"
            )
