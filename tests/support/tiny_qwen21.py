"""Tiny Qwen-Image 2.1 modular-pipeline folders with random weights, built from config under a fixed
seed (float32) and saved as diffusers saves a modular pipeline: a `modular_model_index.json` (no
`model_index.json`) naming `processor`, `scheduler`, `text_encoder`, `transformer` and `vae`, each in
its subfolder (safetensors for the models). The guider and the image processor are not saved: the
blocks make them from their own configs (`ClassifierFreeGuidance` at guidance scale 1.0, which is
CFG off, and a `VaeImageProcessor` whose `vae_scale_factor` is 16 whatever the VAE). Two variants:
`QwenImage21ModularPipeline` (the base model: 40 steps by default, CFG when a guider with a scale
above 1 is set) and `QwenImage21TurboModularPipeline` (the few-step checkpoint: no guider and no
negative prompt; its sampling grid is the index's `sample_sigmas`, a config value saved at the top
of `modular_model_index.json`, which it uses in place of `num_inference_steps` unless `sigmas` are
passed).

The parts follow the real ones where the pipeline reads them:

* the text encoder is a `Qwen3VLForConditionalGeneration` whose last decoder layer (before the final
  norm, which the text step bypasses with a hook) is the context, `context_in_dim` wide; its vision
  tower has Qwen3-VL's 16-pixel patches over 2 frames, merged 2×2 (plus one deepstack layer), so an
  edit's condition images run through the real vision path: one `<|image_pad|>` per 32×32 pixels;
* the VAE is `AutoencoderKLQwenImage21` (RGBA in and out, residual blocks, `dim_mult` of five
  stages: four spatial downsamples, 16×, as the real one; `vae_scale_factor = 2 **
  len(temperal_downsample)` is what the pipeline computes), with per-channel `latents_mean` /
  `latents_std` made up under the seed. 16× is needed, not just faithful: the transformer expands
  each vision slot of the prompt into 2×2 latent tokens, so a condition image's vision tokens (one
  per 32 px square) only match its latents (one per 16 px) at 16×;
* the transformer is `QwenImage21Transformer2DModel` with `causal_condition` (text and condition
  tokens modulated from t = 0, which is what makes the KV cache valid), consuming the VAE's latents
  unpatched (`in_channels` = `z_dim`);
* the scheduler is `FlowMatchEulerDiscreteScheduler` with Qwen-Image's published config (exponential
  shift with mu from the latent length, terminal sigma 0.02): the blocks load it from the folder
  (its spec has no config), so a folder must ship one.

What is tiny: 2 text layers of width 32 (2 heads of 16, one key/value head), a 2-layer vision tower
of width 16; a 2-layer transformer of 2 heads × 16 (rotary axes 4, 6, 6 summing to the head, as 16,
56, 56 sum to 128); the VAE at widths 4 (encoder) and 6 (decoder) with 16 latent channels (64 in the
real one) and one residual block a stage. 32×32 is the smallest image (the pipeline rounds height
and width down to 2 × 16): a 2×2 latent, one vision slot. The tokenizer is tiny_flux2's byte-level
Qwen tokenizer with Qwen3-VL's vision tokens added; the image processor's pixel floor is 32² where
Qwen3-VL's is 65536 (256²), which would upscale any condition image under 256² and break the
slot/latent match: at `output_resolution` under 256 the real pipeline cannot edit.

The processor is published as a `Qwen3VLProcessor`, which transformers 5 cannot build without
torchvision (its video processor needs it). The folder records that class, as the real one does;
tiny_flux3's `ImageOnlyQwen3VLProcessor` (the same class without the video half: same text
expansion of each `<|image_pad|>` into `grid_t × grid_h × grid_w / merge²` tokens, same
`pixel_values` and `image_grid_thw` from `Qwen2VLImageProcessorPil`) saves it and is what the
diffusers pipeline is given here (`load_reference`).

`python -m tests.support.tiny_qwen21` builds both variants, loads them back into the diffusers
pipelines and makes 32×32 RGBA images from text, with CFG and a negative prompt, and from two RGBA
condition images (an edit), each with the KV cache on and off."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
from diffusers.modular_pipelines import (
    QwenImage21AutoBlocks,
    QwenImage21ModularPipeline,
    QwenImage21TurboAutoBlocks,
    QwenImage21TurboModularPipeline,
)
from PIL import Image
from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from tests.support.tiny_flux2 import build_qwen_tokenizer
from tests.support.tiny_flux3 import ImageOnlyQwen3VLProcessor
from tests.support.tiny_qwen import QWEN_IMAGE_SCHEDULE

TEXT_HIDDEN = 32  # the text encoder's width = the transformer's context_in_dim (4096 in the real one)
LATENT_CHANNELS = 16  # the VAE's z_dim = the transformer's in_channels (64 in the real one)
VAE_SCALE_FACTOR = 16  # 2 ** len(temperal_downsample), as the real VAE's
IMAGE_SIZE = 32  # the smallest: height and width are rounded down to 2 × VAE_SCALE_FACTOR
VARIANTS = ("base", "turbo")
# The Turbo folder's sampling grid (`sample_sigmas` in its index): four steps, not evenly spaced, so
# a run that fell back to `num_inference_steps` (np.linspace(1, 1/N, N)) would show.
TURBO_SIGMAS = (1.0, 0.875, 0.625, 0.25)
HUB_IDS = {"base": "Qwen/Qwen-Image-2.1-tiny", "turbo": "Qwen/Qwen-Image-2.1-Turbo-tiny"}
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen3-VL's chat template reduced to what it renders for plain turns: content as a string or as
# blocks (text, image, video). The text step reads it for one thing, the length of the tokenized
# system turn it then drops from the front of each prompt.
QWEN3_VL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _processor() -> ImageOnlyQwen3VLProcessor:
    """Qwen3-VL's processor: its image preprocessing (16-pixel patches, 2 frames, merged 2×2, mean
    and std 0.5) with a 32² pixel floor, over the tiny Qwen tokenizer with the vision tokens."""
    tokenizer = build_qwen_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS[:2]]}
    )
    tokenizer.add_tokens(list(VISION_TOKENS[2:]), special_tokens=True)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": IMAGE_SIZE * IMAGE_SIZE, "longest_edge": 16777216},
    )
    return ImageOnlyQwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN3_VL_TEMPLATE
    )


def _qwen3_vl(processor: ImageOnlyQwen3VLProcessor) -> Qwen3VLForConditionalGeneration:
    """Tiny Qwen3-VL: 2 text layers, 2 query heads of 16 sharing one key/value head, M-RoPE sections
    (interleaved, as Qwen3-VL's) summing to half a head; a 2-layer vision tower at the real patch,
    frame and merge sizes whose first layer also feeds the first text layer (deepstack). The vision
    token ids are the tokenizer's, as the model finds the image positions by them."""
    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 2 * TEXT_HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def _transformer() -> QwenImage21Transformer2DModel:
    """Tiny Qwen-Image 2.1 DiT: 2 single-stream blocks of 2 heads × 16, rotary axes (frame, height,
    width) 4, 6, 6 summing to the head; `causal_condition` as the real one. Every parameter is then
    spread by N(0, 0.2²): at PyTorch's default initialisation the velocity is so small next to the
    noise that another prompt moves two steps' latents by 0.01 (here by about 3), and the zero-centred
    norms and unit q/k norms would hide a weight read as `scale` instead of `scale - 1`."""
    transformer = QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=TEXT_HIDDEN,
        axes_dims_rope=(4, 6, 6),
        causal_condition=True,
    )
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return transformer


def _vae() -> AutoencoderKLQwenImage21:
    """The RGBA VAE at 16×: five stages of widths 1, 1, 2, 4, 4 × 4 (decoder × 6, wider than the
    encoder as the real 144 to 96), the real temporal flags; statistics that are not the identity,
    so a missing normalisation shows."""
    return AutoencoderKLQwenImage21(
        base_dim=4,
        decoder_base_dim=6,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=(0.5 * torch.randn(LATENT_CHANNELS)).tolist(),
        latents_std=(0.75 + 0.5 * torch.rand(LATENT_CHANNELS)).tolist(),
        in_channels=4,
        out_channels=4,
    ).eval()


def _blocks(variant: str) -> QwenImage21AutoBlocks | QwenImage21TurboAutoBlocks:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return QwenImage21TurboAutoBlocks() if variant == "turbo" else QwenImage21AutoBlocks()


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_qwen21_folder(folder: Path, variant: str = "base") -> Path:
    """variant "base": `QwenImage21ModularPipeline`'s folder; "turbo":
    `QwenImage21TurboModularPipeline`'s (the same parts, `sample_sigmas` in the index)."""
    blocks = _blocks(variant)
    torch.manual_seed(0)
    processor = _processor()
    pipe = blocks.init_pipeline()
    pipe.update_components(
        processor=processor,
        text_encoder=_qwen3_vl(processor),
        transformer=_transformer(),
        vae=_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULE),
    )
    if variant == "turbo":
        pipe.update_components(sample_sigmas=list(TURBO_SIGMAS))
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)

    # As published: the processor a Qwen3VLProcessor, every part under the Hub's id, which a download
    # keeps (server/pipeline/loading/modular.py); diffusers loads a part whose subfolder is present
    # from the folder itself.
    def publish(index: dict[str, Any]) -> None:
        index["processor"][:2] = ["transformers", "Qwen3VLProcessor"]
        index["processor"][2]["type_hint"] = ["transformers", "Qwen3VLProcessor"]
        for name in ("processor", "scheduler", "text_encoder", "transformer", "vae"):
            index[name][2]["pretrained_model_name_or_path"] = HUB_IDS[variant]

    _edit_json(folder / "modular_model_index.json", publish)
    for name in ("processor_config.json", "tokenizer_config.json"):
        _edit_json(folder / "processor" / name, lambda d: d.update(processor_class="Qwen3VLProcessor"))
    return folder


def load_reference(folder: Path, variant: str) -> QwenImage21ModularPipeline:
    """The diffusers modular pipeline of a folder `build_qwen21_folder` made: every part the index
    loads from the folder (float32, CPU, as saved), the processor as its image-only class (no
    torchvision here); the guider and image processor as the blocks make them. The Turbo's class,
    `QwenImage21TurboModularPipeline`, is a subclass of the base's."""
    blocks = _blocks(variant)
    index = json.loads((folder / "modular_model_index.json").read_text())
    if index["_blocks_class_name"] != type(blocks).__name__:
        raise ValueError(f"{folder} holds {index['_class_name']}, not the {variant!r} variant")
    pipe = blocks.init_pipeline(str(folder))
    pipe.load_components(names=["text_encoder", "transformer", "vae", "scheduler"])
    pipe.update_components(processor=ImageOnlyQwen3VLProcessor.from_pretrained(folder / "processor"))
    _quiet(pipe._blocks)  # the pipeline's own blocks (`pipe.blocks` is a copy)
    return pipe


def _quiet(blocks: Any) -> None:
    """No progress bar in any loop, however deep (the pipeline's `set_progress_bar_config` only
    reaches its top-level blocks; the denoise loop sits three levels down)."""
    if hasattr(blocks, "set_progress_bar_config"):
        blocks.set_progress_bar_config(disable=True)
    for sub_block in getattr(blocks, "sub_blocks", {}).values():
        _quiet(sub_block)


def reference_image(
    pipe: QwenImage21ModularPipeline,
    prompt: str,
    *,
    height: int,
    width: int,
    steps: int | None,
    seed: int,
    negative_prompt: str | None = None,
    guidance_scale: float | None = None,
    images: list[Image.Image] | None = None,
    use_kv_cache: bool = True,
    output_resolution: int | None = None,
    sigmas: list[float] | None = None,
) -> np.ndarray:
    """The pipeline's image, [height, width, 4] float32 RGBA in [0, 1] (output_type "np": the
    decoded x / 2 + 0.5, clamped, all four channels). `images` (condition images) select the edit
    path; `output_resolution` is the side of the square area they are resized to (rounded to 32;
    None: the pipeline's 1024); `guidance_scale` None keeps the blocks' guider (1.0, CFG off) and is
    refused by the Turbo, as is a negative prompt; `steps` None is the pipeline's default (the base's
    40, the Turbo's `sample_sigmas`), and a Turbo whose folder has `sample_sigmas` refuses any other
    count, which it would ignore."""
    turbo = isinstance(pipe, QwenImage21TurboModularPipeline)
    kwargs: dict[str, Any] = {}
    if turbo:
        if guidance_scale is not None or negative_prompt is not None:
            raise ValueError("the Turbo pipeline has no guider: no guidance scale, no negative prompt")
        grid = pipe.config.get("sample_sigmas")
        if steps is not None and sigmas is None and grid is not None and steps != len(grid):
            raise ValueError(f"the Turbo folder samples its {len(grid)} sample_sigmas; got steps={steps}")
    else:
        # A guider every call (the blocks' spec, its scale replaced), so no call inherits another's.
        spec = next(s for s in pipe.blocks.expected_components if s.name == "guider")
        pipe.update_components(
            guider=spec.create() if guidance_scale is None else spec.create(guidance_scale=guidance_scale)
        )
        if negative_prompt is not None:
            kwargs["negative_prompt"] = negative_prompt
    if steps is not None:
        kwargs["num_inference_steps"] = steps
    if sigmas is not None:
        kwargs["sigmas"] = list(sigmas)
    if images is not None:
        kwargs["image"] = list(images)
    if output_resolution is not None:
        kwargs["output_resolution"] = output_resolution
    out = pipe(
        prompt=prompt,
        height=height,
        width=width,
        use_kv_cache=use_kv_cache,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        output="images",
        **kwargs,
    )
    return np.asarray(out[0], dtype=np.float32)


def condition_images() -> list[Image.Image]:
    """Two RGBA condition images: a red disc on a transparent 32² square, and a 64×32 strip fading
    from opaque blue to transparent green."""
    size = IMAGE_SIZE
    yy, xx = np.mgrid[:size, :size]
    disc = np.zeros((size, size, 4), dtype=np.uint8)
    inside = (yy - size / 2 + 0.5) ** 2 + (xx - size / 2 + 0.5) ** 2 < (size / 3) ** 2
    disc[inside] = (220, 30, 30, 255)
    strip = np.zeros((size, 2 * size, 4), dtype=np.uint8)
    fade = np.linspace(0.0, 1.0, 2 * size)
    strip[..., 1] = (200 * fade).astype(np.uint8)
    strip[..., 2] = (200 * (1 - fade)).astype(np.uint8)
    strip[..., 3] = (255 * (1 - fade)).astype(np.uint8)
    return [Image.fromarray(disc), Image.fromarray(strip)]  # 4 channels of uint8: RGBA


def vision_slots(pipe: QwenImage21ModularPipeline, image: Image.Image) -> int:
    """How many `<|image_pad|>` tokens the processor gives `image`: the transformer fills each with
    2×2 latent tokens, so this is (height / 32) × (width / 32) for an image the pipeline resized."""
    inputs = pipe.processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image.convert("RGB")]
    )
    return int((np.asarray(inputs["input_ids"]) == pipe.processor.image_token_id).sum())


if __name__ == "__main__":
    import tempfile
    import time

    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as root:
        for variant in VARIANTS:
            started = time.perf_counter()
            folder = build_qwen21_folder(Path(root) / variant, variant)
            pipe = load_reference(folder, variant)
            parts = sorted(p.name for p in folder.iterdir())
            print(f"{variant}: {type(pipe).__name__} {parts}, {time.perf_counter() - started:.1f}s")
            scale = pipe.vae_scale_factor
            for image in condition_images():
                resized = image.resize(
                    (image.width // (2 * scale) * 2 * scale, image.height // (2 * scale) * 2 * scale)
                )
                latents = (resized.width // scale) * (resized.height // scale)
                print(
                    f"  {resized.size}: {vision_slots(pipe, resized)} vision slots, {latents} latent tokens"
                )
            cases: list[tuple[str, dict[str, Any]]] = [("text", {})]
            if variant == "base":
                cases.append(("text, CFG 4", {"guidance_scale": 4.0, "negative_prompt": "blurry"}))
            cases.append(("edit, 2 RGBA", {"images": condition_images(), "output_resolution": 64}))
            first = None
            for name, more in cases:
                runs, took = {}, {}
                for cache in (True, False):
                    t = time.perf_counter()
                    runs[cache] = reference_image(
                        pipe,
                        "a red circle",
                        height=IMAGE_SIZE,
                        width=IMAGE_SIZE,
                        steps=2 if variant == "base" else None,
                        seed=0,
                        use_kv_cache=cache,
                        **more,
                    )
                    took[cache] = time.perf_counter() - t
                image = runs[True]
                first = image if first is None else first
                print(
                    f"  {name:13s} {image.shape} {image.dtype} in [{image.min():.3f}, {image.max():.3f}],"
                    f" off text by {np.abs(image - first).max():.3f}; KV cache on/off max diff"
                    f" {np.abs(runs[True] - runs[False]).max():.1e} ({took[True]:.2f}s / {took[False]:.2f}s)"
                )
            print(f"  {variant}: {time.perf_counter() - started:.1f}s in all")
