"""Qwen-Image-Edit (`QwenImageEditPipeline`) and Edit-2509 (`QwenImageEditPlusPipeline`): Qwen-Image's
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
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from torch import nn

from server.engine.denoisers.blocks import REFERENCE_SHAPES, REFERENCES
from server.engine.denoisers.flux import pack
from server.errors import InvalidRequest
from server.pipeline.families.base import TextEmbeddings, padded_text
from server.pipeline.families.qwenimage import QwenImage

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
