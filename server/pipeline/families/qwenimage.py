"""Qwen-Image (`QwenImagePipeline`): a 20 B double-stream MMDiT over 2x2-packed 16-channel latents
(`server/engine/denoisers/qwenimage.py`), conditioned on Qwen2.5-VL's last hidden states, with
true CFG and a Wan-style VAE whose latents are normalized per channel.

The prompt is wrapped in the pipeline's chat template, the encoder runs on it, and the template's
first `TEMPLATE_TOKENS` tokens are dropped: each prompt keeps its own tokens (at most
`TEXT_TOKENS`), zero-padded with a mask (the spec drops what no row uses). Guidance is true CFG
only (the transformer has no guidance input): `true_cfg_scale` (4.0 by default, as diffusers'),
on when a negative prompt is given, its combined prediction rescaled to the positive one's norm
per token.

Qwen-Image-Edit (`QwenImageEditPipeline`) and Edit-2509 (`QwenImageEditPlusPipeline`): Qwen-Image's
transformer and VAE, conditioned on the images to edit twice, as the pipelines do:

- through Qwen2.5-VL with the prompt: each image (Edit: resized to about 1 megapixel; Plus: to
  about 384², "Picture 1: ...") joins the chat template as vision tokens, which stay in the
  context after the template's first 64 tokens are dropped;
- as reference latents: each image resized to about 1 megapixel (multiples of 32), VAE-encoded
  (its mode), normalized per channel and packed, joined after the noise's tokens (positions at
  frame 1, 2, ...) and cut off at the end (`server/engine/denoisers/qwenimage.py`).

The output's size is the first image's (Plus: the last's) at about 1 megapixel, as the pipelines'.
Its processor loads without its torchvision half (`server/pipeline/loading/processors.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from server.engine.denoisers.blocks import REFERENCE_SHAPES, REFERENCES, TEXT_MASK
from server.engine.denoisers.flux import pack
from server.engine.denoisers.qwenimage import TEXT_TOKENS
from server.errors import InvalidRequest, ModelFolderError
from server.pipeline.families.base import TextEmbeddings, other_width, padded_text
from server.pipeline.families.flow import PackedFlow
from server.requests.generation import GenerationRequest

# QwenImagePipeline's prompt_template_encode and prompt_template_encode_start_idx
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_TOKENS = 34
TOKENIZER_LENGTH = 1024  # the pipeline's tokenizer_max_length: tokens past it are cut before encoding

# Qwen/Qwen2.5-VL-7B-Instruct's config (text_encoder/config.json of Qwen/Qwen-Image), for
# `plan --config` to count: 8.3 B parameters; the VAE's config is AutoencoderKLQwenImage's defaults
QWEN25_VL_7B = {
    "text_config": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "out_hidden_size": 3584,
        "intermediate_size": 3420,
        "num_heads": 16,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
    "tie_word_embeddings": False,
}
QWEN_VAE: dict[str, Any] = {}  # the class's defaults are Qwen-Image's: 16 channels, 8x spatial


def _qwen_vae() -> nn.Module:
    return AutoencoderKLQwenImage.from_config(QWEN_VAE)


class QwenImage(PackedFlow):
    name: ClassVar[str] = "qwen-image"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImagePipeline",)
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = QwenImageTransformer2DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder",)
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer",)
    default_steps: ClassVar[int] = 50  # QwenImagePipeline's
    default_guidance: ClassVar[float] = 1.0  # no guidance input: guided by true_cfg_scale
    takes_guidance: ClassVar[bool] = False
    default_true_cfg: ClassVar[float] = 4.0  # QwenImagePipeline's
    keep_precise: ClassVar[tuple[str, ...]] = ("img_in", "txt_in", "norm_out", "proj_out")
    # 1328² (the model card's square size) is 1.68x the 1024² default
    default_area: ClassVar[float] = 1.75
    reference_parts: ClassVar[dict[str, Any]] = {
        "text_encoder": lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_7B)),
        "vae": _qwen_vae,
    }
    reference_vae: ClassVar[dict[str, Any] | None] = {"temperal_downsample": [False, True, True], "z_dim": 16}
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        "qwen-image": {}
    }  # Qwen/Qwen-Image: the defaults

    text_tokens: ClassVar[int] = TEXT_TOKENS  # a prompt's tokens kept (after the template's)
    controlnets: ClassVar[tuple[str, ...]] = ("QwenImageControlNetModel",)
    control_on_positive: ClassVar[bool] = True  # QwenImageControlNetPipeline: the negative row reuses them

    def control_refusal(self, config: dict[str, Any]) -> str | None:
        if config.get("extra_condition_channels"):
            return "an inpainting Qwen-Image ControlNet (a mask's channels) is not supported yet"
        return other_width(config, self.config.denoiser)

    def control_image(
        self, net: nn.Module, image: Any, width: int, height: int, vae: nn.Module, generator: torch.Generator
    ) -> torch.Tensor:
        """QwenImageControlNetPipeline's: RGB in [-1, 1], a one-frame video encoded by the VAE (a
        sample, drawn from the request's generator before its noise), normalized, packed."""
        processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        pixels = processor.preprocess(image, height=height, width=width)
        device = next(vae.parameters()).device
        latents = vae.encode(self.vae_pixels(pixels.to(device, vae.dtype))).latent_dist.sample(generator)
        return pack(self.scale_latents(latents))

    def control_residuals(self, net: nn.Module, inputs: Any, image: torch.Tensor) -> dict[str, Any]:
        sample = inputs.sample
        _, _, h, w = sample.shape
        samples = net(
            hidden_states=pack(sample),
            controlnet_cond=image.to(sample.dtype),
            conditioning_scale=1.0,
            timestep=inputs.timestep.to(sample.dtype) / 1000,
            encoder_hidden_states=inputs.context,
            encoder_hidden_states_mask=inputs.conditioning.get(TEXT_MASK),
            img_shapes=[(1, h // 2, w // 2)],
            return_dict=False,
        )
        return {"controlnet_block_samples": tuple(samples)}

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """QwenImagePipeline._get_qwen_prompt_embeds: the templated prompts through Qwen2.5-VL's
        language model (its last hidden states), each prompt's own tokens after the template's."""
        encoder, tokenizer = encoders[0], tokenizers[0]
        device = next(encoder.parameters()).device
        tokens = tokenizer(
            [TEMPLATE.format(p) for p in prompts],
            max_length=TOKENIZER_LENGTH + TEMPLATE_TOKENS,
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask.to(device)
        model = getattr(encoder, "model", encoder)  # the hidden states without the LM head's logits
        states = model(input_ids=tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True)
        return padded_text(states.hidden_states[-1], mask, TEMPLATE_TOKENS, self.text_tokens)

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        return {}  # the text mask comes with the embeddings (`TextEmbeddings.rows`)

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)

    def guide(
        self, negative: torch.Tensor, positive: torch.Tensor, request: GenerationRequest, expert: int = 0
    ) -> torch.Tensor:
        """True CFG rescaled to the positive prediction's norm over each packed token's features."""
        combined = negative + self.cfg_scale(request) * (positive - negative)
        scale = pack(positive).norm(dim=-1, keepdim=True) / pack(combined).norm(dim=-1, keepdim=True)
        return combined * _unpacked_scale(scale, combined.shape)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.config.vae.get("temperal_downsample", (False, True, True)))

    def _stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vae, shape = self.config.vae, (1, self.latent_channels, 1, 1, 1)
        mean = torch.tensor(vae["latents_mean"], device=latents.device).view(shape).to(latents.dtype)
        std = torch.tensor(vae["latents_std"], device=latents.device).view(shape).to(latents.dtype)
        return mean, std

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """[N, C, 1, h, w]: the VAE's one-frame video, denormalized as the pipeline does it."""
        latents = latents[:, :, None]
        mean, std = self._stats(latents)
        return latents / (1.0 / std) + mean

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels[:, :, None]  # a one-frame video, as QwenImageImg2ImgPipeline encodes it

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return ((latents - mean) * (1.0 / std))[:, :, 0]

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if not encoders:
            raise ModelFolderError("a Qwen-Image folder needs text_encoder (Qwen2.5-VL) and its tokenizer")
        config = self.config.denoiser
        for flag in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
            if config.get(flag):
                raise ModelFolderError(f"this transformer sets {flag}; diffusers' QwenImagePipeline does not")


def _unpacked_scale(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A per-token factor [N, tokens, 1] of packed 2x2 patches as [N, 1, h, w] over the latents."""
    _, _, h, w = shape
    return (
        scale.view(shape[0], 1, h // 2, 1, w // 2, 1).expand(-1, -1, -1, 2, -1, 2).reshape(shape[0], 1, h, w)
    )


# QwenImageEditPipeline's (and Plus's) prompt_template_encode and its start index
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
    "objects, background), then explain how the user's text instruction should alter or modify the image. "
    "Generate a new image that meets the user's requirements while maintaining consistency with the original "
    "input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_TEMPLATE_TOKENS = 64
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
PICTURE = "Picture {}: " + VISION  # Plus: each image named
VAE_AREA, CONDITION_AREA = 1024 * 1024, 384 * 384  # the pipelines' sizes of the images they encode


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """The pipelines' (width, height) of `area` pixels at `ratio`, each a multiple of 32."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


class QwenImageEdit(QwenImage):
    name: ClassVar[str] = "qwen-image-edit"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer", "processor")  # the processor encodes
    edits_by_reference: ClassVar[bool] = True
    sees_images: ClassVar[bool] = True
    # the vision tokens of the images stay in the context: ~1370 for a 1 MP image (Edit), ~200 a
    # 384² image (Plus), beside the prompt's; the pipelines keep them all, so do we up to this
    text_tokens: ClassVar[int] = 4096
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"qwen-image-edit": {}}  # Qwen/Qwen-Image-Edit

    @property
    def plus(self) -> bool:
        return self.config.index.get("_class_name") == "QwenImageEditPlusPipeline"

    def edit_size(self, edit: Any) -> tuple[int, int]:
        image = edit.images[-1] if self.plus else edit.image
        width, height = calculate_dimensions(VAE_AREA, image.width / image.height)
        return width - width % self.size_multiple, height - height % self.size_multiple

    def check_request(self, request: Any) -> None:
        if request.edit is None:
            raise InvalidRequest("image", "this model edits images: send one to /v1/images/edits")
        if request.edit.mask is not None:
            raise InvalidRequest("mask", f"a {self.name} model edits by reference: it takes no mask")
        if request.edit.more and not self.plus:
            raise InvalidRequest("image", "this model edits one image (Qwen-Image-Edit-2509 takes several)")

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str], images: list[Any]
    ) -> TextEmbeddings:
        """_get_qwen_prompt_embeds: each prompt with its images through the processor and the VL
        model (its last hidden states), the template's first 64 tokens dropped."""
        encoder, processor = encoders[0], tokenizers[1]
        texts, shown = [], []
        for prompt, given in zip(prompts, images, strict=True):
            given = given or ()
            names = [PICTURE.format(i + 1) if self.plus else VISION for i in range(len(given))]
            named = "".join(names)
            texts.append(EDIT_TEMPLATE.format(named + prompt))
            shown += [self._condition(image) for image in given]
        inputs = processor(text=texts, images=shown or None, padding=True, return_tensors="pt")
        device = next(encoder.parameters()).device
        model = getattr(encoder, "model", encoder)  # the hidden states without the LM head's logits
        states = model(
            input_ids=inputs["input_ids"].to(device),
            attention_mask=inputs["attention_mask"].to(device),
            pixel_values=_moved(inputs.get("pixel_values"), device, encoder.dtype),
            image_grid_thw=_moved(inputs.get("image_grid_thw"), device),
            output_hidden_states=True,
        ).hidden_states[-1]
        mask = inputs["attention_mask"].to(device)
        return padded_text(states, mask, EDIT_TEMPLATE_TOKENS, self.text_tokens)

    def _condition(self, image: Image.Image) -> Image.Image:
        """The image as the VL model sees it: at about 384² (Plus) or 1 megapixel (Edit)."""
        area = CONDITION_AREA if self.plus else VAE_AREA
        width, height = calculate_dimensions(area, image.width / image.height)
        return VaeImageProcessor(vae_scale_factor=self.size_multiple).resize(image, height, width)

    def references(self, vae: nn.Module, request: Any, rows: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """Each image at about 1 megapixel, VAE-encoded (mode), normalized, packed."""
        processor = VaeImageProcessor(vae_scale_factor=self.size_multiple)
        device = next(vae.parameters()).device
        tokens, shapes = [], []
        for image in request.edit.images:
            width, height = calculate_dimensions(VAE_AREA, image.width / image.height)
            if not self.plus:  # Edit preprocesses the image it resized; Plus the one it was given
                image = processor.resize(image, height, width)
            pixels = processor.preprocess(image, height, width).to(device, vae.dtype)
            latents = self.scale_latents(vae.encode(self.vae_pixels(pixels)).latent_dist.mode())
            tokens.append(pack(latents))
            shapes.append((latents.shape[-2] // 2, latents.shape[-1] // 2))
        conditioning = {
            REFERENCES: torch.cat(tokens, dim=1),
            REFERENCE_SHAPES: torch.tensor([shapes]).float(),
        }
        return {k: v.expand(rows, -1, -1) for k, v in conditioning.items()}, tuple(shapes)


def _moved(tensor: torch.Tensor | None, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """`tensor` on `device` (floating ones in `dtype`); None stays None."""
    if tensor is None:
        return None
    return tensor.to(device, dtype) if dtype is not None else tensor.to(device)
