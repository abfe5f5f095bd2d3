"""FLUX.1 (dev, schnell): a transformer over 2x2-packed 16-channel latents (the engine's spec packs
them), conditioned on T5's tokens and CLIP's pooled vector, a flow-matching schedule shifted by
the image's token count, and a VAE with a shift factor.

FLUX.1-dev is guidance-distilled: `guidance_scale` is an input of the model (one row per image,
`guidance` per row, so requests with different scales share a call), not classifier-free
guidance. True CFG is diffusers' `true_cfg_scale` with a negative prompt: a second row, as other
families guide. schnell has no guidance input at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from diffusers.image_processor import VaeImageProcessor
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from server.engine.denoisers.flux import T5_TOKENS, image_ids, pack
from server.errors import ModelFolderError
from server.pipeline.families.base import TextEmbeddings, other_width, tokenize
from server.pipeline.families.flow import PackedFlow
from server.requests.generation import GenerationRequest

# FLUX.1's transformer/config.json (dev and schnell differ only in guidance_embeds): diffusers'
# FluxTransformer2DModel defaults, written out
FLUX1 = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "axes_dims_rope": (16, 56, 56),
}
# The other parts of the FLUX.1 folders, for `plan --config` to count: text_encoder_2/config.json
# (T5 v1.1 XXL's encoder), text_encoder/config.json (CLIP ViT-L/14's text tower), vae/config.json
T5_XXL_ENCODER = {
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
    "tie_word_embeddings": False,
}
CLIP_L = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 49408,
    "max_position_embeddings": 77,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
FLUX_VAE = {
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2,
    "latent_channels": 16,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}


class Flux(PackedFlow):
    name: ClassVar[str] = "flux"
    pipeline_classes: ClassVar[tuple[str, ...]] = (
        "FluxPipeline",
        "FluxImg2ImgPipeline",
        "FluxInpaintPipeline",
    )
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = FluxTransformer2DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer", "tokenizer_2")
    default_steps: ClassVar[int] = 28  # FluxPipeline's
    default_guidance: ClassVar[float] = 3.5  # FluxPipeline's
    controlnets: ClassVar[tuple[str, ...]] = ("FluxControlNetModel",)
    # as SD3's (sd3.py): the projections in and the output head
    keep_precise: ClassVar[tuple[str, ...]] = ("x_embedder", "context_embedder", "norm_out", "proj_out")
    # 1.5 megapixels: 16 rows of it reserve activations that leave both stages of a 2x24 GiB split
    # room beside the 22 GiB of transformer and 9 GiB of T5 (plan --config flux-dev)
    default_area: ClassVar[float] = 1.5
    reference_parts: ClassVar[dict[str, Any]] = {
        "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(**CLIP_L)),
        "text_encoder_2": lambda: T5EncoderModel(T5Config(**T5_XXL_ENCODER)),
        "vae": lambda: AutoencoderKL.from_config(FLUX_VAE),
    }
    reference_vae: ClassVar[dict[str, Any] | None] = FLUX_VAE
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        "flux-dev": {**FLUX1, "guidance_embeds": True},  # black-forest-labs/FLUX.1-dev
        "flux-schnell": {**FLUX1, "guidance_embeds": False},  # black-forest-labs/FLUX.1-schnell
    }

    @property
    def guidance_embeds(self) -> bool:
        """Guidance-distilled (dev): the guidance scale is the model's input."""
        return bool(self.config.denoiser.get("guidance_embeds", False))

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """T5's tokens (padded to 512, no mask, as FluxPipeline) and CLIP's pooled output."""
        (clip, t5), (clip_tokenizer, t5_tokenizer) = encoders[:2], tokenizers[:2]
        ids = tokenize(clip_tokenizer, prompts).input_ids.to(next(clip.parameters()).device)
        pooled = clip(ids, output_hidden_states=False).pooler_output
        tokens = t5_tokenizer(
            prompts, padding="max_length", max_length=T5_TOKENS, truncation=True, return_tensors="pt"
        ).input_ids
        context = t5(tokens.to(next(t5.parameters()).device), output_hidden_states=False)[0]
        return TextEmbeddings(context, pooled.to(context.dtype))

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        extras = {"pooled_projections": pooled}
        if self.guidance_embeds:  # per row: requests with other guidance scales share the call
            extras["guidance"] = torch.full((pooled.shape[0],), request.guidance_scale, device=pooled.device)
        return extras

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)  # the text and image position ids depend on the size only: the spec makes them

    def control_refusal(self, config: dict[str, Any]) -> str | None:
        if config.get("conditioning_embedding_channels") is not None:
            return "an XLabs-style FLUX ControlNet (its input_hint_block takes pixels) is not supported yet"
        if config.get("num_mode") is not None:
            return "a union FLUX ControlNet (control modes) is not supported yet"
        return other_width(config, self.config.denoiser)

    def control_image(
        self, net: nn.Module, image: Any, width: int, height: int, vae: nn.Module, generator: torch.Generator
    ) -> torch.Tensor:
        """FluxControlNetPipeline's: RGB in [-1, 1], encoded by the VAE (a sample, drawn from the
        request's generator before its noise, as the pipeline draws it), scaled, packed."""
        pixels = VaeImageProcessor(vae_scale_factor=16).preprocess(image, height=height, width=width)
        device = next(vae.parameters()).device
        latents = vae.encode(pixels.to(device, vae.dtype)).latent_dist.sample(generator)
        return pack(self.scale_latents(latents))

    def control_residuals(self, net: nn.Module, inputs: Any, image: torch.Tensor) -> dict[str, Any]:
        sample, context = inputs.sample, inputs.context
        _, _, h, w = sample.shape
        blocks, singles = net(
            hidden_states=pack(sample),
            controlnet_cond=image,
            conditioning_scale=1.0,
            timestep=inputs.timestep.to(sample.dtype) / 1000,
            guidance=inputs.conditioning.get("guidance") if net.config.guidance_embeds else None,
            pooled_projections=inputs.conditioning["pooled_projections"],
            encoder_hidden_states=context,
            txt_ids=torch.zeros(context.shape[1], 3, device=sample.device, dtype=sample.dtype),
            img_ids=image_ids(h, w, sample.device, sample.dtype),
            return_dict=False,
        )
        return {
            "controlnet_block_samples": tuple(blocks) if blocks is not None else None,
            "controlnet_single_block_samples": tuple(singles) if singles is not None else None,
        }

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if len(encoders) < 2:
            raise ModelFolderError(
                "a FLUX.1 folder needs text_encoder (CLIP) and text_encoder_2 (T5) with their tokenizers"
            )
