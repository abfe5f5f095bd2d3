"""Z-Image (`ZImagePipeline`; Z-Image-Turbo is the checkpoint people run): a 6 B single-stream DiT
(`server/engine/denoisers/zimage.py`) over FLUX.1's 16-channel VAE latents, conditioned on Qwen3's
second-to-last hidden states.

A prompt goes through the tokenizer's chat template (a user turn, thinking enabled, as the
pipeline asks), padded to 512 tokens; each prompt keeps its own tokens (zero-padded with a mask).
Guidance is classifier-free when `guidance_scale` > 0, as the pipeline's: the prompt's prediction
plus the scale times its difference from the negative's (`pos + g · (pos − neg)`: 0 is off, not
1). The Turbo is distilled to 8 steps without guidance: the defaults are its (diffusers' example: 8
steps, guidance 0; the older advice of 9 counted a final step the pipeline no longer wastes). A
base Z-Image folder carries its own in a recommended.json, or clients set them.
cfg_normalization and cfg_truncation stay at the pipeline's defaults (off).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKL, ZImageTransformer2DModel
from torch import nn
from transformers import Qwen3Config, Qwen3Model

from server.engine.denoisers.qwenimage import TEXT_TOKENS
from server.errors import ModelFolderError
from server.pipeline.families.base import Family, TextEmbeddings, padded_text
from server.pipeline.families.flow import PackedFlow
from server.pipeline.families.flux import FLUX_VAE
from server.requests.generation import GenerationRequest

# Qwen/Qwen3-4B's config (Tongyi-MAI/Z-Image-Turbo's text_encoder/config.json), for `plan --config`
QWEN3_4B = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


class ZImage(PackedFlow):
    name: ClassVar[str] = "z-image"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("ZImagePipeline",)
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = ZImageTransformer2DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder",)
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer",)
    default_steps: ClassVar[int] = 8  # ZImagePipeline's example for the Turbo
    default_guidance: ClassVar[float] = 0.0  # the Turbo is guidance-distilled
    takes_true_cfg: ClassVar[bool] = False
    keep_precise: ClassVar[tuple[str, ...]] = ("all_x_embedder", "cap_embedder", "all_final_layer")
    default_area: ClassVar[float] = 2.0  # the model card's sizes reach 2 megapixels
    reference_parts: ClassVar[dict[str, Any]] = {
        "text_encoder": lambda: Qwen3Model(Qwen3Config(**QWEN3_4B)),
        "vae": lambda: AutoencoderKL.from_config(FLUX_VAE),
    }
    reference_vae: ClassVar[dict[str, Any] | None] = FLUX_VAE
    # Tongyi-MAI/Z-Image-Turbo's transformer/config.json: the class's defaults but the rotary lengths
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"z-image": {"axes_lens": [1536, 512, 512]}}

    def rows(self, request: GenerationRequest) -> int:
        return Family.rows(self, request) if request.guidance_scale > 0 else 1  # the pipeline's `> 0`

    lone_rows = 1  # the Turbo runs unguided

    def cfg_scale(self, request: GenerationRequest, expert: int = 0) -> float:
        return request.guidance_scale

    def noise_dtype(self, dtype: torch.dtype, edit: bool) -> torch.dtype:
        return dtype if edit else torch.float32  # ZImagePipeline's float32; its img2img's prompts'

    def guide(
        self, negative: torch.Tensor, positive: torch.Tensor, request: GenerationRequest, expert: int = 0
    ) -> torch.Tensor:
        return positive + self.cfg_scale(request) * (positive - negative)  # ZImagePipeline's

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """ZImagePipeline._encode_prompt: each templated prompt's own second-to-last hidden states."""
        encoder, tokenizer = encoders[0], tokenizers[0]
        device = next(encoder.parameters()).device
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=True,
            )
            for p in prompts
        ]
        tokens = tokenizer(
            texts, padding="max_length", max_length=TEXT_TOKENS, truncation=True, return_tensors="pt"
        )
        mask = tokens.attention_mask.to(device).bool()
        model = getattr(encoder, "model", encoder)  # Qwen3Model: a causal LM's, without its head
        states = model(input_ids=tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True)
        return padded_text(states.hidden_states[-2], mask, 0, TEXT_TOKENS)

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        return {}  # the text mask comes with the embeddings (`TextEmbeddings.rows`)

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)

    @property
    def latent_channels(self) -> int:
        return int(self.config.vae.get("latent_channels", self.config.denoiser.get("in_channels", 16)))

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if not encoders:
            raise ModelFolderError("a Z-Image folder needs text_encoder (Qwen3) and its tokenizer")
        config = self.config.denoiser
        if config.get("siglip_feat_dim") is not None:
            raise ModelFolderError(
                "this transformer takes SigLIP images (Z-Image Omni); diffshard serves Z-Image"
            )
        if tuple(config.get("all_patch_size", (2,))) != (2,) or tuple(
            config.get("all_f_patch_size", (1,))
        ) != (1,):
            raise ModelFolderError(
                "a Z-Image transformer of 2x2 patches, one frame, as ZImagePipeline runs it"
            )
