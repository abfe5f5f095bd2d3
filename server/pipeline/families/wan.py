"""Wan 2.1 text-to-video (`WanPipeline`): a video transformer over 1×2×2 patches of every latent
frame (`server/engine/denoisers/wan.py`), UMT5's tokens (each prompt's own, zero-padded to 512),
classifier-free guidance as two rows, a flow-matching schedule, and a causal 3D VAE (8× spatial,
4× temporal: a video of 1 + 4k frames is 1 + k latent frames) whose latents are normalized by
per-channel means and standard deviations.

A video is one row (two when guided): its frames are latent frames of that row, so videos at
different steps batch the way images do. An image (a request with no frames: the Images API) is
a one-frame video, as WanPipeline makes it with num_frames=1."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from server.engine.denoisers.wan import UMT5_TOKENS
from server.errors import ModelFolderError
from server.pipeline.families.base import Family, TextEmbeddings

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers and -14B-Diffusers, transformer/config.json (14B: the class's
# defaults), text_encoder/config.json (UMT5-XXL's encoder) and vae/config.json (the defaults).
WAN_1_3B = {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
UMT5_XXL_ENCODER = {
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "vocab_size": 256384,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
    "tie_word_embeddings": False,
}
WAN_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "temperal_downsample": [False, True, True]}


def prompt_clean(text: str) -> str:
    """WanPipeline's cleaning: HTML entities undone, whitespace collapsed (ftfy is not installed)."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


class Wan(Family):
    name: ClassVar[str] = "wan"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("WanPipeline",)
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = WanTransformer3DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder",)
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer",)
    schedulers: ClassVar[tuple[str, ...]] = ("default",)  # flow matching: the folder's own
    step_caches: ClassVar[tuple[str, ...]] = ("off", "first_block")
    keep_precise: ClassVar[tuple[str, ...]] = ("proj_out",)  # the output head, as for the other DiTs
    default_steps: ClassVar[int] = 50
    default_guidance: ClassVar[float] = 5.0
    default_frames: ClassVar[int | None] = 81
    default_area: ClassVar[float] = 1.0
    reference_parts: ClassVar[dict[str, Any]] = {
        "text_encoder": lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL_ENCODER)),
        "vae": lambda: AutoencoderKLWan.from_config(WAN_VAE),
    }
    reference_vae: ClassVar[dict[str, Any] | None] = WAN_VAE
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"wan-1.3b": WAN_1_3B, "wan-14b": {}}

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """WanPipeline._get_t5_prompt_embeds: each prompt's own tokens, zeros after them."""
        encoder = encoders[0]
        device = next(encoder.parameters()).device
        tokens = tokenizers[0](
            [prompt_clean(p) for p in prompts], padding="max_length", max_length=UMT5_TOKENS,
            truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )  # fmt: skip
        mask = tokens.attention_mask
        states = encoder(tokens.input_ids.to(device), mask.to(device)).last_hidden_state
        keep = mask.gt(0).to(device)[..., None]  # each prompt's own tokens
        return TextEmbeddings(states * keep)

    @property
    def _temporal(self) -> tuple[bool, ...]:
        return tuple(self.config.vae.get("temperal_downsample", (False, True, True)))

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self._temporal)

    @property
    def frame_multiple(self) -> int:  # type: ignore[override]
        return 2 ** sum(self._temporal)

    @property
    def latent_channels(self) -> int:
        return int(self.config.vae.get("z_dim", self.config.denoiser["in_channels"]))

    @property
    def native_size(self) -> int:
        return 480  # Wan 2.1's 480p (its pipeline's default is 480×832)

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * int(self.config.denoiser.get("patch_size", (1, 2, 2))[-1])

    def latent_shape(self, width: int, height: int, frames: int | None = None) -> tuple[int, ...]:
        """A video's latents; an image's (`frames` None) are a one-frame video's, as Wan draws them."""
        scale, frames = self.vae_scale_factor, frames or 1
        latent_frames = (frames - 1) // self.frame_multiple + 1
        return (1, self.latent_channels, latent_frames, height // scale, width // scale)

    def init_noise_sigma(self, scheduler: Any) -> float:
        return 1.0  # flow matching starts from pure noise

    def model_input(self, scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return latents

    def _stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vae, shape = self.config.vae, (1, self.latent_channels, 1, 1, 1)
        mean = torch.tensor(vae["latents_mean"], device=latents.device).view(shape).to(latents.dtype)
        std = torch.tensor(vae["latents_std"], device=latents.device).view(shape).to(latents.dtype)
        return mean, std

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return latents * std + mean

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return (latents - mean) / std

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if not encoders:
            raise ModelFolderError("a Wan folder needs text_encoder (UMT5) and its tokenizer")
