"""Tiny FLUX.3 modular-pipeline folders with random weights, built from config under fixed seeds and
saved as diffusers saves a modular pipeline: a `modular_model_index.json` (no `model_index.json`)
naming `text_encoder`, `tokenizer`, `transformer` and `vae`, each in its subfolder as safetensors;
the scheduler, guider and image processor are not saved, as the blocks make them from their own
configs (`Flux3SetTimestepsStep`: FlowMatchEulerDiscreteScheduler with shift 6.93; the guider's
scale 3.5). `Flux3ModularPipeline` (the base model: true CFG) and `Flux3DistilledModularPipeline`
(the step-distilled flow map: 16 steps, no guidance, a target timestep a step).

The parts follow the real ones where the pipeline reads them: a Qwen3-VL text encoder whose 8
hidden layers (4, 8, ..., 32: the text step's `text_encoder_out_layers`) side by side make the
context, so it has 33 layers (transformers' last `hidden_states` entry is the final norm's output)
and the transformer's `joint_attention_dim` is 8 × its width, as FLUX.3's 20480 is 8 × Qwen3-VL-4B's
2560; the FLUX.2 VAE (AutoencoderKLFlux2, batch-norm statistics made up under the seed) patchified
2×2; four rotary axes (t, h, w, l).

The tokenizer is published as a `Qwen3VLProcessor`, which transformers 5 cannot build without
torchvision (its video processor needs it). The folder records that class, as the real one does;
`ImageOnlyQwen3VLProcessor` (the same class without the video half) saves it and is what the
diffusers pipeline is given here (`load_reference`); the text encoder step only calls its
`apply_chat_template` and its `tokenizer`.

`python -m tests.support.tiny_flux3` builds both, loads them back into the diffusers pipelines and
makes a 32×32 image from text and from a reference image."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import Flux3Transformer2DModel
from diffusers.modular_pipelines import (
    Flux3AutoBlocks,
    Flux3DistilledAutoBlocks,
    Flux3DistilledModularPipeline,
    Flux3ModularPipeline,
)
from PIL import Image
from transformers import (
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)

from tests.support.tiny_flux2 import LATENT_CHANNELS, TEXT_HIDDEN, _vae, build_qwen_tokenizer

OUT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)  # Flux3TextEncoderStep's text_encoder_out_layers
IMAGE_SIZE = 32  # pixels: 8×8 tokens (the tiny VAE's 2×, then the 2×2 patch: 4 px a token)
VARIANTS = ("base", "distilled")


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without its video processor (the one part that needs torchvision):
    transformers reads a processor's parts from its `__init__` signature, so this one has two."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _processor() -> ImageOnlyQwen3VLProcessor:
    """Qwen3-VL's image preprocessing (16-pixel patches, merged 2×2) over the tiny Qwen tokenizer,
    whose template answers a text turn as Qwen3-VL's does."""
    tokenizer = build_qwen_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]}
    )
    tokenizer.add_tokens(["<|image_pad|>", "<|video_pad|>"], special_tokens=True)
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2)
    return ImageOnlyQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _qwen3_vl(vocabulary: int) -> Qwen3VLForConditionalGeneration:
    """Tiny Qwen3-VL: one layer past the deepest the text step reads, 2 heads of 8, M-RoPE's
    sections summing to half a head; a one-layer vision tower the text path never runs."""
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": vocabulary,
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": TEXT_HIDDEN,
            "num_hidden_layers": max(OUT_LAYERS) + 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN,
            "deepstack_visual_indexes": [0],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def _transformer(flow_map: bool) -> Flux3Transformer2DModel:
    """Tiny FLUX.3 DiT: 2 heads × 16, two per-mode blocks a mode and two joint blocks, four rotary
    axes of 4 summing to the head size (FLUX.3's 4 × 32 = 128)."""
    return Flux3Transformer2DModel(
        in_channels=4 * LATENT_CHANNELS,
        cond_in_channels=4 * LATENT_CHANNELS,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=len(OUT_LAYERS) * TEXT_HIDDEN,
        axes_dims_rope=(4, 4, 4, 4),
        flow_map=flow_map,
    )


def build_flux3_folder(folder: Path, variant: str = "base") -> Path:
    """variant "base": `Flux3ModularPipeline`'s folder; "distilled": `Flux3DistilledModularPipeline`'s
    (a flow-map transformer)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    torch.manual_seed(0)
    processor = _processor()
    blocks = Flux3DistilledAutoBlocks() if variant == "distilled" else Flux3AutoBlocks()
    pipe = blocks.init_pipeline()
    pipe.update_components(
        transformer=_transformer(flow_map=variant == "distilled"),
        vae=_vae(),
        text_encoder=_qwen3_vl(len(processor.tokenizer)),
    )
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)
    processor.save_pretrained(folder / "tokenizer")
    # the index as published: the tokenizer a Qwen3VLProcessor loaded by AutoProcessor, every part
    # under the Hub's id, which a download keeps (server/pipeline/loading/modular.py)
    index_file = folder / "modular_model_index.json"
    index = json.loads(index_file.read_text())
    index["tokenizer"] = [
        "transformers",
        "Qwen3VLProcessor",
        {
            "pretrained_model_name_or_path": "black-forest-labs/FLUX.3-tiny",
            "revision": None,
            "subfolder": "tokenizer",
            "type_hint": ["transformers", "AutoProcessor"],
            "variant": None,
        },
    ]
    for name in ("text_encoder", "transformer", "vae"):
        index[name][2]["pretrained_model_name_or_path"] = "black-forest-labs/FLUX.3-tiny"
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True))
    return folder


def load_reference(folder: Path) -> Flux3ModularPipeline | Flux3DistilledModularPipeline:
    """The diffusers modular pipeline of a folder `build_flux3_folder` made, every part loaded, the
    processor as its image-only class (no torchvision here), without the prompt upsampler (a
    separate language model the step loads: the blocks' doc says to pop it to encode prompts as
    given, as diffshard does unless its folder is named)."""
    index = json.loads((folder / "modular_model_index.json").read_text())
    distilled = index["_class_name"] == Flux3DistilledModularPipeline.__name__
    blocks = Flux3DistilledAutoBlocks() if distilled else Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline(str(folder))
    pipe.load_components(names=["text_encoder", "transformer", "vae"])
    pipe.update_components(tokenizer=ImageOnlyQwen3VLProcessor.from_pretrained(folder / "tokenizer"))
    return pipe


def reference_image(size: int = 48) -> Image.Image:
    """A red square on grey, 48 px: not a multiple of 16, so a lone reference is padded."""
    pixels = np.full((size, size, 3), 128, dtype=np.uint8)
    pixels[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = (220, 30, 30)
    return Image.fromarray(pixels)


if __name__ == "__main__":
    import tempfile
    import time

    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as root:
        for variant in VARIANTS:
            started = time.perf_counter()
            folder = build_flux3_folder(Path(root) / variant, variant)
            pipe = load_reference(folder)
            print(variant, type(pipe).__name__, sorted(p.name for p in folder.iterdir()))
            for image in (None, reference_image()):
                more = {} if image is None else {"image": image}
                out = pipe(
                    prompt="a red circle",
                    height=IMAGE_SIZE,
                    width=IMAGE_SIZE,
                    num_inference_steps=2,
                    generator=torch.Generator("cpu").manual_seed(0),
                    output_type="np",
                    output="images",
                    **more,
                )
                print(f"{variant:10s} image {image is not None}: {out.shape} std {out.std():.4f}")
            print(f"{variant:10s} built, loaded and ran in {time.perf_counter() - started:.1f}s")
