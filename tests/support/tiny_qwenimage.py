"""A tiny Qwen-Image-shaped pipeline folder with random weights, built from config under a fixed
seed (diffusers' own test's dummy components, tests/pipelines/qwenimage/test_qwenimage.py): a
double-stream MMDiT of 4 heads (a group of two splits them), tests/support/tiny_qwen.py's two-layer
Qwen2.5-VL encoder and local tokenizer (the template's first 34 tokens are its system prompt, as
the real one's), and a 4x Wan-style VAE with per-channel statistics that are not the identity, so
a 32² image is 16 tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)

from tests.support.tiny_qwen import TEXT_HIDDEN, _text_encoder, build_qwen_tokenizer

# Qwen/Qwen-Image's scheduler/scheduler_config.json
QWEN_IMAGE_SCHEDULE = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


def qwen_vae() -> AutoencoderKLQwenImage:
    """4 latent channels, 4x spatial; statistics that are not the identity, so a wrong
    normalization shows."""
    return AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.7, 1.0, 2.0],
    )


def build_qwen_image_folder(folder: Path, heads: int = 4) -> Path:
    """`heads` attention heads of 16 (4: a sequence group of two splits them, Ulysses)."""
    torch.manual_seed(0)
    tokenizer = build_qwen_tokenizer()
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=heads,
        joint_attention_dim=TEXT_HIDDEN,
        axes_dims_rope=(8, 4, 4),
    )
    QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULE),
        vae=qwen_vae(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=transformer,
    ).save_pretrained(folder, safe_serialization=True)
    return folder
