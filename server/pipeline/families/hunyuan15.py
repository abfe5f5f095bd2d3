"""HunyuanVideo-1.5 text-to-video (`HunyuanVideo15Pipeline`; its image-to-video, `HunyuanVideo15I2V`
below, adds a first frame): a double-stream video transformer over 1×1×1 patches
(`server/engine/denoisers/hunyuan15.py`), a 16× spatial, 4× temporal VAE (a video of 1 + 4k
frames is 1 + k latent frames, scaled by `scaling_factor` alone), and two prompt encoders:
Qwen2.5-VL's language model (the prompt in its chat template after the pipeline's system
message, the hidden states three from the end, the system prefix cropped: 1000 tokens with a
mask) and ByT5 over the prompt's quoted text (the glyph model: 256 tokens, zeros with an empty
mask when nothing is quoted). Both come from the pipeline's own encoding functions, so the
templates, crops and glyph extraction are diffusers' to the byte.

The guider (`guider/guider_config.json`, `ClassifierFreeGuidance`) is classifier-free guidance
as two rows; its scale is the folder's default (6 for the base models, 1 for the step-distilled
ones). The schedule is flow matching's sigmas from 1 towards 0 in `steps` (the pipeline's own,
shifted by the folder's scheduler). A video is one row (two when guided), so videos at different
steps batch as images do; an image (no frames: the Images API) is a one-frame video."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from torch import nn
from transformers import (
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from server.engine.denoisers.blocks import TEXT_MASK
from server.engine.denoisers.hunyuan15 import GLYPH_MASK, GLYPH_TOKENS, GLYPHS, IMAGE, TEXT_TOKENS
from server.engine.denoisers.wan import IMAGE as IMAGE_TOKENS
from server.errors import ModelFolderError
from server.pipeline.families.base import Family, TextEmbeddings, plain_guider
from server.pipeline.steps.schedulers import FLOW_FOLDER_SCHEDULERS
from server.requests.clip import Clip
from server.requests.generation import GenerationRequest

# For `plan --config` to count, as hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v holds them: the
# language model of Qwen/Qwen2.5-VL-7B-Instruct (7.6 B, no vision tower), google/byt5-small's
# encoder grown by the glyph model's color and font tokens, and the VAE (the class's defaults).
QWEN25_VL_7B_TEXT = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}
BYT5_SMALL_ENCODER = {
    "d_model": 1472,
    "d_ff": 3584,
    "d_kv": 64,
    "num_heads": 6,
    "num_layers": 12,
    "vocab_size": 1510,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
}
SIGLIP_SO400M = {  # google/siglip-so400m-patch14-384's vision tower: 729 tokens of 1152
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "image_size": 384,
    "patch_size": 14,
}
HUNYUAN15_VAE = {
    "latent_channels": 32,
    "block_out_channels": [128, 256, 512, 1024, 1024],
    "layers_per_block": 2,
    "spatial_compression_ratio": 16,
    "temporal_compression_ratio": 4,
    "scaling_factor": 1.03682,
}
PREFIX_TOKENS = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx: the system prefix cropped
DEFAULT_ASPECT = (16, 9)  # the pipeline's default_aspect_ratio (width, height)


class HunyuanVideo15(Family):
    name: ClassVar[str] = "hunyuanvideo-1.5"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("HunyuanVideo15Pipeline",)
    # refusals say it
    served: ClassVar[str] = "diffshard serves HunyuanVideo-1.5's text-to-video and image-to-video"
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = HunyuanVideo15Transformer3DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer", "tokenizer_2")
    schedulers: ClassVar[tuple[str, ...]] = ("default",)  # flow matching: the folder's own
    folder_schedulers: ClassVar[tuple[str, ...]] = FLOW_FOLDER_SCHEDULERS
    step_caches: ClassVar[tuple[str, ...]] = ("off", "first_block")
    keep_precise: ClassVar[tuple[str, ...]] = ("proj_out",)  # the output head, as for the other DiTs
    default_steps: ClassVar[int] = 50
    task: ClassVar[str] = "t2v"  # the transformer's `task_type` its pipeline takes
    reference_parts: ClassVar[dict[str, Any]] = {
        "text_encoder": lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN25_VL_7B_TEXT)),
        "text_encoder_2": lambda: T5EncoderModel(T5Config(**BYT5_SMALL_ENCODER)),
        "vae": lambda: AutoencoderKLHunyuanVideo15.from_config(HUNYUAN15_VAE),
    }
    reference_vae: ClassVar[dict[str, Any] | None] = HUNYUAN15_VAE
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        # hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v (the class's defaults) and -720p_t2v
        "hunyuanvideo-1.5-480p": {"task_type": "t2v"},
        "hunyuanvideo-1.5-720p": {"task_type": "t2v", "target_size": 960},
    }

    @property
    def default_guidance(self) -> float:  # type: ignore[override]
        """The folder's guider's scale (HunyuanVideo15Pipeline guides with it; 6 if unread)."""
        return float(self.config.guider.get("guidance_scale", 6.0))

    def rows(self, request: GenerationRequest) -> int:
        """Two rows unless the scale is 1 (the guider's test: any other scale guides)."""
        return 1 if math.isclose(request.guidance_scale, 1.0) else 2

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """HunyuanVideo15Pipeline.encode_prompt: Qwen2.5-VL's cropped states with their mask, and
        the glyph model's tokens of the quoted text with theirs."""
        (text, glyphs), (tokenizer, glyph_tokenizer) = encoders[:2], tokenizers[:2]
        device = next(text.parameters()).device
        states, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
            text, tokenizer, prompts, device, tokenizer_max_length=TEXT_TOKENS, crop_start=PREFIX_TOKENS
        )
        glyph_states, glyph_mask = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
            glyph_tokenizer, glyphs, prompts, device, tokenizer_max_length=GLYPH_TOKENS
        )
        rows = {
            TEXT_MASK: mask.float(),
            GLYPHS: glyph_states.to(states.dtype),
            GLYPH_MASK: glyph_mask.float(),
        }
        return TextEmbeddings(states, rows=rows)

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)  # the text mask, the glyph tokens and theirs

    # Latents and their schedule.

    @property
    def vae_scale_factor(self) -> int:
        return int(self.config.vae.get("spatial_compression_ratio", 16))

    @property
    def latent_channels(self) -> int:
        return int(self.config.vae.get("latent_channels", self.config.denoiser["out_channels"]))

    @property
    def inpainting_channels(self) -> int:
        return 0  # a first frame's latents and mask: zeros in text-to-video, added by the spec

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * int(self.config.denoiser.get("patch_size", 1))

    @property
    def native_size(self) -> int:
        """`target_size` (its config's, in pixels: 640 at 480p): a square of its area."""
        return int(self.config.denoiser.get("target_size", 640))

    @property
    def clip(self) -> Clip:
        """The pipeline's default clip: 121 frames at the 16:9 size of `target_size`² pixels
        (848×480 at 480p, as its image processor rounds it); 1 + 4k frames (the VAE's 4×)."""
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae_scale_factor)
        width, height = DEFAULT_ASPECT
        height, width = processor.calculate_default_height_width(height, width, self.native_size)
        multiple = int(self.config.vae.get("temporal_compression_ratio", 4))
        return Clip(frames=121, size=(width, height), frame_multiple=multiple)

    def latent_shape(self, width: int, height: int, frames: int | None = None) -> tuple[int, ...]:
        """A video's latents; an image's (`frames` None) are a one-frame video's."""
        scale = self.vae_scale_factor
        return (1, self.latent_channels, self.clip.latent(frames or 1), height // scale, width // scale)

    def set_timesteps(self, scheduler: Any, steps: int, device: torch.device, latent_shape: tuple) -> None:
        """The pipeline's sigmas: `steps` from 1 towards 0 (the scheduler shifts them)."""
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=device)

    def init_noise_sigma(self, scheduler: Any) -> float:
        return 1.0  # flow matching starts from pure noise

    def model_input(self, scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return latents

    def noised(
        self, scheduler: Any, clean: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        return scheduler.scale_noise(clean, t, noise)

    # What a folder must hold.

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if len(encoders) < 2:
            raise ModelFolderError(
                "a HunyuanVideo-1.5 folder needs text_encoder (Qwen2.5-VL) and text_encoder_2 (ByT5) "
                "with their tokenizers"
            )

    def check_configs(self, where: str) -> None:
        super().check_configs(where)
        if refusal := plain_guider(self.config.guider):
            raise ModelFolderError(f"{where}/{refusal}; {self.served}")
        config, pipeline = self.config.denoiser, self.pipeline_classes[0]
        if config.get("use_meanflow"):
            raise ModelFolderError(
                f"{where}/transformer/config.json is a super-resolution (meanflow) model; {self.served}"
            )
        task = config.get("task_type", "i2v")  # the class's default
        if task != self.task:
            raise ModelFolderError(
                f"{where}/transformer/config.json's task_type is {task!r}, where a {pipeline} folder "
                f"takes {self.task!r}; {self.served}"
            )


class HunyuanVideo15I2V(HunyuanVideo15):
    """HunyuanVideo-1.5 image-to-video (`HunyuanVideo15ImageToVideoPipeline`): its text-to-video
    with a first frame twice, as the pipeline does it. The frame sizes the video where the request
    names no size (`target_size`² pixels at the image's aspect) and is resized to it by cropping;
    SigLIP's vision encoder (`image_encoder`, `feature_extractor`) gives its 729 tokens
    (`image_embeds`, the same on the negative row), and the VAE its latents: scaled, on the first
    latent frame of C channels (zeros after) beside a one-channel mask (1 on that frame), the
    C + 1 channels concatenated to the noise at every step. Every request needs its frame."""

    pipeline_classes: ClassVar[tuple[str, ...]] = ("HunyuanVideo15ImageToVideoPipeline",)
    image_encoders: ClassVar[tuple[str, ...]] = ("image_encoder",)
    processors: ClassVar[tuple[str, ...]] = ("feature_extractor",)
    takes_reference: ClassVar[bool] = True
    task: ClassVar[str] = "i2v"
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"hunyuanvideo-1.5-480p-i2v": {}}
    reference_parts: ClassVar[dict[str, Any]] = {
        **HunyuanVideo15.reference_parts,
        "image_encoder": lambda: SiglipVisionModel(SiglipVisionConfig(**SIGLIP_SO400M)),
    }

    def _processor(self) -> HunyuanVideo15ImageProcessor:
        return HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae_scale_factor, do_convert_rgb=True)

    def reference_size(self, image: Any) -> tuple[int, int]:
        height, width = self._processor().calculate_default_height_width(
            image.size[1], image.size[0], self.native_size
        )
        return width, height

    def fit_reference(self, image: Any, width: int, height: int) -> Any:
        """Resized to cover the size and cropped to it, as the pipeline does (a frame already
        that size stays as it is)."""
        return self._processor().resize(image.convert("RGB"), height=height, width=width, resize_mode="crop")

    def first_frame(self, vae: nn.Module, pixels: torch.Tensor, frames: int) -> torch.Tensor:
        """prepare_cond_latents_and_mask for one video of `frames` frames: [1, C + 1, latent
        frames, h, w] float32."""
        vae_device = next(vae.parameters()).device
        latents = vae.encode(pixels[:, :, None].to(vae_device, vae.dtype)).latent_dist.mode()
        latents = latents.to(torch.float32) * vae.config.scaling_factor
        condition = latents.new_zeros(1, latents.shape[1] + 1, self.clip.latent(frames), *latents.shape[-2:])
        condition[:, :-1, :1] = latents
        condition[:, -1:, :1] = 1.0
        return condition

    def encode_images(self, encoder: nn.Module, processor: Any, images: list[Any]) -> torch.Tensor:
        """SigLIP's last hidden states of each first frame, as the pipeline's `_get_image_embeds`."""
        # imported here: its module imports SigLIP's image processor, which warns without
        # torchvision, at every start of every family
        from diffusers import HunyuanVideo15ImageToVideoPipeline

        device = next(encoder.parameters()).device
        return HunyuanVideo15ImageToVideoPipeline._get_image_embeds(encoder, processor, images, device)

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        kwargs = dict(extras)
        kwargs[IMAGE] = kwargs.pop(IMAGE_TOKENS)  # the pipeline's key for a frame's tokens, the model's
        return kwargs

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        super().check(encoders, denoiser)
        if not self.config.index.get("image_encoder") or self.config.index["image_encoder"][0] is None:
            raise ModelFolderError(
                "a HunyuanVideo-1.5 image-to-video folder needs image_encoder (SigLIP) and feature_extractor"
            )
