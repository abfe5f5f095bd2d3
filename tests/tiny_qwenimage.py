"""A tiny Qwen-Image-shaped pipeline folder with random weights, built from config under a fixed
seed (diffusers' own test's dummy components, tests/pipelines/qwenimage/test_qwenimage.py, with a
tokenizer made here: no download): a double-stream MMDiT, a two-layer Qwen2.5-VL encoder, a Wan-style
VAE with per-channel statistics that are not the identity, and Qwen-Image's scheduler config."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

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
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")


def build_qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE without merges (every byte its own token: any text tokenizes) and the
    chat template's special tokens, as Qwen2's tokenizer marks them."""
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
    return tokenizer


def qwen_vl_encoder(tokenizer: Qwen2Tokenizer, hidden: int = 16) -> Qwen2_5_VLForConditionalGeneration:
    """Two layers of Qwen2.5-VL's language model (and vision tower) at width `hidden`."""
    ids = {name.strip("<|>"): tokenizer.convert_tokens_to_ids(name) for name in CHAT_TOKENS}
    text = {
        "hidden_size": hidden,
        "intermediate_size": hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": len(tokenizer),
        "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        "rope_theta": 1000000.0,
    }
    vision = {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": hidden,
    }
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vocab_size=len(tokenizer),
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
        image_token_id=ids["image_pad"],
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen_vae() -> AutoencoderKLQwenImage:
    """4 latent channels, 4x spatial; statistics that are not the identity, so a wrong
    normalization shows."""
    return AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.7, 1.0, 2.0],
    )  # fmt: skip


def build_qwen_image_folder(folder: Path, heads: int = 4) -> Path:
    """`heads` attention heads of 16 (4: a sequence group of two splits them, Ulysses)."""
    torch.manual_seed(0)
    tokenizer = build_qwen_tokenizer()
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=heads, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    )  # fmt: skip
    QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULE),
        vae=qwen_vae(),
        text_encoder=qwen_vl_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=transformer,
    ).save_pretrained(folder, safe_serialization=True)
    return folder
