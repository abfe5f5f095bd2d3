"""Random LoRA adapters for the tiny denoisers, in diffusers' (PEFT) keys, seeded."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    WanTransformer3DModel,
)
from safetensors.torch import save_file
from torch import nn

REFERENCE = {
    "sd15": StableDiffusionPipeline,
    "sdxl": StableDiffusionXLPipeline,
    "sd3": StableDiffusion3Pipeline,
}


NO_T5 = {"sd3": {"text_encoder_3": None, "tokenizer_3": None}}  # the tiny SD3 folder has no T5


RANK = 4


# what trainers target: the UNet's attention projections and the text encoder's
UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def random_lora(folder: Path, out: Path, seed: int, kind: str, rank: int = RANK) -> Path:
    """A LoRA (rank 4 unless asked) on the denoiser's attention and the first text encoder, large enough to
    change the image visibly; diffusers/PEFT keys (`unet.<module>.lora_A.weight`, ...)."""
    pipe = REFERENCE[kind].from_pretrained(folder, local_files_only=True, **NO_T5.get(kind, {}))
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    denoiser = "transformer" if kind == "sd3" else "unet"
    parts = (
        (denoiser, getattr(pipe, denoiser), UNET_TARGETS),
        ("text_encoder", pipe.text_encoder, TEXT_TARGETS),
    )
    list(random_pairs(parts, generator, rank, tensors))  # drawn in this order: the file's bytes
    save_file(tensors, out)
    return out


def random_pairs(parts, generator: torch.Generator, rank: int, tensors: dict[str, torch.Tensor]):
    """Random `lora_A`/`lora_B` pairs, put in `tensors`, for every Linear of each (part, model,
    target suffixes) whose name ends with a target; yields (part, module name, module) per pair."""
    for part, model, targets in parts:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.endswith(targets):
                fan_out, fan_in = module.weight.shape
                tensors[f"{part}.{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.3
                tensors[f"{part}.{name}.lora_B.weight"] = (
                    torch.randn(fan_out, rank, generator=generator) * 0.3
                )
                yield part, name, module


def random_transformer_lora(model_class: type[nn.Module], folder: Path, out: Path, seed: int = 1) -> Path:
    """A rank-4 LoRA on every attention projection of the folder's transformer (a `model_class`),
    in the diffusers/PEFT file format: what the DiT families' LoRA loaders take."""
    transformer = model_class.from_pretrained(folder / "transformer", local_files_only=True)
    tensors: dict[str, torch.Tensor] = {}
    parts = (("transformer", transformer, UNET_TARGETS),)
    list(random_pairs(parts, torch.Generator().manual_seed(seed), 4, tensors))
    assert tensors, f"no attention projection in {folder}/transformer"
    save_file(tensors, out)
    return out


def random_wan_lora(folder: Path, out: Path, seed: int) -> Path:
    """Wan's (its loader takes no text-encoder part)."""
    return random_transformer_lora(WanTransformer3DModel, folder, out, seed)
