"""Qwen-Image 2.1 (`QwenImage21ModularPipeline`: the guider's CFG, 1.0 by default, 40 steps) and
its Turbo (`QwenImage21TurboModularPipeline`: no guidance, the folder's `sample_sigmas`). Both are
diffusers modular pipelines (`server/pipeline/loading/modular.py`) and run
`server/engine/denoisers/qwenimage21.py` over the RGBA VAE's normalized latents, unpatched (a
token per latent pixel, 16 px a side): the images it makes have an alpha channel (`alpha`).

A prompt goes through Qwen3-VL in the pipeline's raw template (a system turn, then the user's),
its hidden states taken before the final norm, the system turn's tokens dropped. An edit's images
(one or more, on `/v1/images/edits`) join the user's turn ("<image1>" and the vision tokens
each), composited over white for the vision tower; the same images, RGBA, are encoded by the VAE
and their latent tokens take the slots the vision tokens hold (`IMAGE_SLOTS`). Each image is
resized to the output's area at its own aspect (the pipeline's `output_resolution`: 1024², or the
requested size's area), and an unsized edit is made at the last image's size.

The schedule is sigmas from 1 to 1/steps (Turbo: its `sample_sigmas`) shifted by `mu` from the
image's token count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from torch import nn
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from server.engine.denoisers.blocks import IMAGE_SLOTS, REFERENCE_SHAPES, REFERENCES, TEXT_MASK
from server.engine.denoisers.qwenimage21 import IMAGE_ROTARY
from server.errors import InvalidRequest, ModelFolderError
from server.pipeline.families.base import TextEmbeddings, plain_guider
from server.pipeline.families.flow import shift_mu
from server.pipeline.families.qwenimage import QwenImage, calculate_dimensions
from server.requests.generation import GenerationRequest

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."  # QWENIMAGE21_SYSTEM_PROMPT
IMAGE_PROMPT = "<image{}><|vision_start|><|image_pad|><|vision_end|>"  # QWENIMAGE21_IMAGE_TEMPLATE
IMAGE_PAD = "<|image_pad|>"
OUTPUT_RESOLUTION = 1024  # the pipeline's default: the output's side, and the area its images fit
TEXT_TOKENS = 4096  # a prompt's Qwen3-VL tokens kept, an edit's image slots among them
IMAGE_TOKENS = TEXT_TOKENS - 512  # an edit's image slots at most (3 images at 1024²): the rest, the prompt's
# Qwen/Qwen3-VL-8B-Instruct: the 4096-wide text encoder the transformer's context_in_dim reads
QWEN3_VL_8B = {
    "text_config": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "out_hidden_size": 4096,
    },
}


class QwenImage21(QwenImage):
    """Qwen-Image 2.1, the base model."""

    name: ClassVar[str] = "qwen-image-2.1"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImage21ModularPipeline",)
    denoiser_class: ClassVar[type[nn.Module]] = QwenImage21Transformer2DModel
    tokenizers: ClassVar[tuple[str, ...]] = ("processor",)
    default_steps: ClassVar[int] = 40  # QwenImage21AutoBlocks' num_inference_steps
    takes_guidance: ClassVar[bool] = True  # the guider's scale: CFG against a negative prompt
    takes_true_cfg: ClassVar[bool] = False
    edits_by_reference: ClassVar[bool] = True
    sees_images: ClassVar[bool] = True
    keep_precise: ClassVar[tuple[str, ...]] = ("img_in", "txt_in", "modulation", "norm_out", "proj_out")
    precise_rows: ClassVar[tuple[str, ...]] = (IMAGE_ROTARY, REFERENCE_SHAPES)
    controlnets: ClassVar[tuple[str, ...]] = ()
    edit_area: ClassVar[int | None] = None  # sized by `edit_size`
    default_area: ClassVar[float] = 1.0
    native_latent: ClassVar[int] = 64  # 1024 px at 16 px a token
    text_tokens: ClassVar[int] = TEXT_TOKENS
    reference_parts: ClassVar[dict[str, Any]] = {
        "text_encoder": lambda: Qwen3VLForConditionalGeneration(Qwen3VLConfig(**QWEN3_VL_8B)),
        "vae": lambda: AutoencoderKLQwenImage21.from_config({}),
    }
    reference_vae: ClassVar[dict[str, Any] | None] = {
        "temperal_downsample": [False, True, True, True],
        "z_dim": 64,
    }
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"qwen-image-2.1": {}}  # the class's defaults

    @property
    def alpha(self) -> bool:
        return True

    @property
    def default_guidance(self) -> float:  # type: ignore[override]
        return float(self.config.guider.get("guidance_scale", 1.0))

    def rows(self, request: GenerationRequest) -> int:
        """Two rows unless the scale is 1 (the guider's test: any other scale guides)."""
        return 1 if math.isclose(request.guidance_scale, 1.0) else 2

    def negative_row(self, request: GenerationRequest) -> bool:
        return self.rows(request) == 2

    lone_rows = 1

    def cfg_scale(self, request: GenerationRequest, expert: int = 0) -> float:
        return request.guidance_scale

    def guide(
        self, negative: torch.Tensor, positive: torch.Tensor, request: GenerationRequest, expert: int = 0
    ) -> torch.Tensor:
        return negative + request.guidance_scale * (positive - negative)  # ClassifierFreeGuidance's

    @property
    def latent_channels(self) -> int:
        return int(self.config.denoiser.get("in_channels", 64))

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.config.vae.get("temperal_downsample", (False, True, True, True)))

    @property
    def size_multiple(self) -> int:
        return 2 * self.vae_scale_factor  # QwenImage21PrepareLatentsStep's multiple_of

    def default_scheduler(self) -> Any:
        """The blocks' own, where the folder ships none."""
        from diffusers.modular_pipelines.qwenimage21.before_denoise import QwenImage21SetTimestepsStep

        spec = next(s for s in QwenImage21SetTimestepsStep().expected_components if s.name == "scheduler")
        return spec.create()

    @property
    def sample_sigmas(self) -> list[float] | None:
        """The Turbo's fixed sigmas (the pipeline config's `sample_sigmas`); None: by steps."""
        return None

    def set_timesteps(self, scheduler: Any, steps: int, device: torch.device, latent_shape: tuple) -> None:
        """QwenImage21SetTimestepsStep: sigmas shifted by `mu` from the latents' token count (a
        token per latent pixel)."""
        sigmas = self.sample_sigmas or np.linspace(1.0, 1 / steps, steps)
        mu = shift_mu(scheduler.config, latent_shape[-2] * latent_shape[-1])
        scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)

    # Prompts.

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str], images: list[Any]
    ) -> TextEmbeddings:
        """get_qwenimage21_prompt_embeds, one prompt at a time (as each is alone): the template
        with its images' tokens, Qwen3-VL's hidden states before its final norm, the system
        turn's tokens dropped; which tokens are image slots."""
        encoder, processor = encoders[0], tokenizers[0]
        device = next(encoder.parameters()).device
        system = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
        drop = len(processor.apply_chat_template(system, tokenize=True, return_dict=False)[0])
        slot_id = processor.tokenizer.encode(IMAGE_PAD)[0]
        context = mask = slots = None
        for row, (prompt, shown) in enumerate(zip(prompts, images, strict=True)):
            shown = list(shown or ())
            named = " ".join(IMAGE_PROMPT.format(i + 1) for i in range(len(shown)))
            text = (
                f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
                f"<|im_start|>user\n{named}{prompt or ' '}<|im_end|>\n<|im_start|>assistant\n"
            )
            inputs = processor(
                text=[text], images=[_over_white(i) for i in shown] or None, padding=True, return_tensors="pt"
            )
            states = _pre_norm_states(encoder, inputs, device)[0, drop:][: self.text_tokens]
            if context is None:
                context = states.new_zeros(len(prompts), self.text_tokens, states.shape[-1])
                mask, slots = (torch.zeros(len(prompts), self.text_tokens) for _ in range(2))
            used = states.shape[0]
            context[row, :used], mask[row, :used] = states, 1
            slots[row, :used] = (inputs["input_ids"][0, drop:][:used] == slot_id).float()
        return TextEmbeddings(context, rows={TEXT_MASK: mask, IMAGE_SLOTS: slots})

    def images_seen(self, request: GenerationRequest) -> tuple[Any, ...]:
        return self._resized(request) if request.edit is not None else ()

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        return {}

    # Edits.

    def _sizes(self, request: GenerationRequest) -> list[tuple[int, int]]:
        """QwenImage21ResizeStep's (width, height) of each image: the output's area
        (`output_resolution`²: 1024², or the size named) at the image's own aspect."""
        sized = (request.width, request.height) != self.edit_size(request.edit)
        side = math.sqrt(request.width * request.height) if sized else OUTPUT_RESOLUTION
        return [
            calculate_dimensions(side * side, image.width / image.height) for image in request.edit.images
        ]

    def _resized(self, request: GenerationRequest) -> tuple[Image.Image, ...]:
        """Each image, RGBA, at its size (`_sizes`)."""
        processor = VaeImageProcessor(vae_scale_factor=16)
        resized = []
        for image, (width, height) in zip(request.edit.images, self._sizes(request), strict=True):
            image = image if image.mode == "RGBA" else image.convert("RGBA")
            resized.append(processor.resize(image, height=height, width=width))
        return tuple(resized)

    def edit_size(self, edit: Any) -> tuple[int, int]:
        """The last image's size at 1024² (QwenImage21AdditionalInputsStep), to the grid."""
        image = edit.images[-1]
        width, height = calculate_dimensions(OUTPUT_RESOLUTION**2, image.width / image.height)
        multiple = self.size_multiple
        return width // multiple * multiple, height // multiple * multiple

    def check_request(self, request: Any) -> None:
        """No mask; an edit's images within the prompt's tokens (each takes a vision token per
        32×32 pixels of its size, and 4 latent tokens of the sequence the first step attends)."""
        if request.edit is None:
            return
        if request.edit.mask is not None:
            raise InvalidRequest("mask", f"a {self.name} model edits by reference: it takes no mask")
        slots = sum(width * height // 32**2 for width, height in self._sizes(request))
        if slots > IMAGE_TOKENS:
            count = len(request.edit.images)
            raise InvalidRequest(
                "image",
                f"{count} image(s) at {request.width}x{request.height}'s area take {slots} vision tokens; "
                f"this model reads at most {IMAGE_TOKENS}: send fewer images or a smaller size",
            )

    def references(self, vae: nn.Module, request: Any, rows: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """QwenImage21VaeEncoderStep: each resized image's latents (the posterior's mode),
        normalized and packed; and each one's (height, width) in tokens."""
        if request.edit is None:
            return {}, ()
        processor, device = VaeImageProcessor(vae_scale_factor=16), next(vae.parameters()).device
        tokens, shapes = [], []
        for image in self._resized(request):
            pixels = processor.preprocess(image, height=image.height, width=image.width)
            latents = vae.encode(pixels[:, :, None].to(device, vae.dtype)).latent_dist.mode()
            mean, std = self._stats(latents)
            latents = ((latents - mean) / std)[:, :, 0]
            tokens.append(latents.flatten(2).transpose(1, 2))
            shapes.append(tuple(latents.shape[-2:]))
        conditioning = {
            REFERENCES: torch.cat(tokens, dim=1),
            REFERENCE_SHAPES: torch.tensor([shapes]).float(),
        }
        return {k: v.expand(rows, -1, -1) for k, v in conditioning.items()}, tuple(shapes)

    # Latents.

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """[N, C, 1, h, w], as QwenImage21DecodeStep denormalizes them."""
        latents = latents[:, :, None]
        mean, std = self._stats(latents)
        return latents * std + mean

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return ((latents - mean) / std)[:, :, 0]

    # Checks.

    def check_configs(self, where: str) -> None:
        if refusal := plain_guider(self.config.guider):
            raise ModelFolderError(f"{where}/{refusal}")
        if not self.config.denoiser.get("causal_condition", True):
            raise ModelFolderError(
                f"{where}/{self.denoiser}/config.json sets causal_condition false: diffshard serves "
                "Qwen-Image 2.1 with its prefix modulated from timestep 0 (what its KV cache needs)"
            )

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if not encoders:
            raise ModelFolderError(f"a {self.name} folder needs text_encoder (Qwen3-VL) and its processor")
        width = encoders[0].config.get_text_config().hidden_size
        if width != denoiser.config.context_in_dim:
            raise ModelFolderError(
                f"the text encoder is {width} wide; the transformer's context_in_dim is "
                f"{denoiser.config.context_in_dim}"
            )


class QwenImage21Turbo(QwenImage21):
    """Qwen-Image 2.1 Turbo: a few steps at its own sigmas, no guidance."""

    name: ClassVar[str] = "qwen-image-2.1-turbo"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImage21TurboModularPipeline",)
    takes_guidance: ClassVar[bool] = False
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"qwen-image-2.1-turbo": {}}

    @property
    def default_guidance(self) -> float:  # type: ignore[override]
        return 1.0

    @property
    def sample_sigmas(self) -> list[float] | None:
        sigmas = self.config.index.get("sample_sigmas")
        return None if sigmas is None else [float(s) for s in sigmas]

    @property
    def default_steps(self) -> int:  # type: ignore[override]
        return len(self.sample_sigmas or ()) or 8

    def rows(self, request: GenerationRequest) -> int:
        return 1

    def check_request(self, request: Any) -> None:
        super().check_request(request)
        sigmas = self.sample_sigmas
        if sigmas is not None and request.steps != len(sigmas):
            raise InvalidRequest(
                "steps",
                f"this model samples at its {len(sigmas)} fixed sigmas: leave it unset or send {len(sigmas)}",
            )


def _over_white(image: Image.Image) -> Image.Image:
    """An RGBA image over white, as the vision tower sees it (get_qwenimage21_prompt_embeds)."""
    if image.mode != "RGBA":
        return image
    white = Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


def _pre_norm_states(encoder: nn.Module, inputs: Any, device: torch.device) -> torch.Tensor:
    """Qwen3-VL's last hidden states before its final norm (the pipeline hooks the norm to pass
    its input through), without the LM head's logits."""
    model = getattr(encoder, "model", encoder)
    text = getattr(model, "language_model", model)
    handle = text.norm.register_forward_hook(lambda module, args, output: args[0])
    kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    for name in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        if name in inputs:
            kwargs[name] = inputs[name]
    kwargs = {
        k: v.to(device, encoder.dtype) if v.is_floating_point() else v.to(device) for k, v in kwargs.items()
    }
    try:
        return model(**kwargs, output_hidden_states=True).hidden_states[-1]
    finally:
        handle.remove()
