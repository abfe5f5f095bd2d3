"""FLUX.2 [dev] (`Flux2Pipeline`: a 32 B transformer, Mistral Small 3's hidden states, embedded
guidance) and FLUX.2 [klein] (`Flux2KleinPipeline`: 4 B and 9 B transformers, Qwen3's, classifier-
free guidance unless step-distilled). Both run `server/engine/denoisers/flux2.py`.

A prompt goes through the tokenizer's chat template (dev: FLUX.2's system message, then the user
turn; klein: the user turn, thinking off), padded to 512 tokens; three of the encoder's hidden
layers, side by side, are the context (padding included: the transformer has no mask). The
latents are drawn as the pipelines draw them, already 2x2-patchified (128 features of the VAE's
32 channels), normalized by the VAE's batch-norm statistics; the schedule's shift is the
pipelines' `compute_empirical_mu` of the token count and the steps.

dev's tokenizer is a PixtralProcessor in the published folder; its text side is a tokenizer with
the processor's chat template (`server/pipeline/loading/processors.py`), since the
processor's image half needs torchvision and text prompts never use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from torch import nn
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

from server.engine.denoisers.blocks import REFERENCE_IDS, REFERENCES
from server.engine.denoisers.flux2 import TEXT_TOKENS
from server.errors import InvalidRequest, ModelFolderError
from server.pipeline.families.base import Family, TextEmbeddings, edit_size
from server.pipeline.families.flow import PackedFlow
from server.requests.generation import GenerationRequest

# black-forest-labs/FLUX.2-dev's transformer/config.json (the class's defaults) and text_encoder
# (Mistral-Small-3.2-24B-Instruct-2506), for `plan --config` to count
MISTRAL_SMALL_3 = {
    "text_config": {
        "model_type": "mistral",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 131072,
        "sliding_window": None,
    },
    "vision_config": {
        "model_type": "pixtral",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
    },
}
# black-forest-labs/FLUX.2-klein-4B and -9B: their transformers and Qwen3-4B / Qwen3-8B encoders
KLEIN_4B = {"num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24, "joint_attention_dim": 7680}
KLEIN_9B = {"num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32, "joint_attention_dim": 12288}
QWEN3_4B = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
FLUX2_VAE: dict[str, Any] = {}  # AutoencoderKLFlux2's defaults are FLUX.2's: 32 channels, 8x


def empirical_mu(tokens: int, steps: int) -> float:
    """Flux2Pipeline's compute_empirical_mu: the schedule's shift by token count and steps."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if tokens > 4300:
        return float(a2 * tokens + b2)
    many, few = a2 * tokens + b2, a1 * tokens + b1  # at 200 steps and at 10
    slope = (many - few) / 190.0
    return float(slope * steps + many - 200.0 * slope)


class Flux2(PackedFlow):
    """FLUX.2 [dev]."""

    name: ClassVar[str] = "flux2"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("Flux2Pipeline",)
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = Flux2Transformer2DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder",)
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer",)
    default_steps: ClassVar[int] = 50  # Flux2Pipeline's
    default_guidance: ClassVar[float] = 4.0  # Flux2Pipeline's (embedded)
    takes_true_cfg: ClassVar[bool] = False  # Flux2Pipeline has no negative prompt
    native_latent: ClassVar[int] = 64  # 1024 px: 64 tokens a side
    keep_precise: ClassVar[tuple[str, ...]] = ("x_embedder", "context_embedder", "norm_out", "proj_out")
    default_area: ClassVar[float] = 2.0  # FLUX.2 makes up to 4 megapixels; 2 keeps activations modest
    hidden_layers: ClassVar[tuple[int, ...]] = (10, 20, 30)  # the pipeline's text_encoder_out_layers
    reference_parts: ClassVar[dict[str, Any]] = {
        "text_encoder": lambda: Mistral3ForConditionalGeneration(Mistral3Config(**MISTRAL_SMALL_3)),
        "vae": lambda: AutoencoderKLFlux2.from_config(FLUX2_VAE),
    }
    reference_vae: ClassVar[dict[str, Any] | None] = {"block_out_channels": (128, 256, 512, 512)}
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"flux2-dev": {}}

    edits_by_reference: ClassVar[bool] = True  # an edit's images are references on the sequence
    edit_area: ClassVar[int | None] = 1024 * 1024  # a larger reference image is scaled down to it

    def rows(self, request: GenerationRequest) -> int:
        return 1  # guidance is embedded: one row, `guidance` per row

    def check_request(self, request: Any) -> None:
        """Flux2ImageProcessor.check_image_input, for every reference image."""
        for image in () if request.edit is None else (request.edit.image, *request.edit.more):
            width, height = image.size
            if min(width, height) < 64 or max(width / height, height / width) > 8:
                raise InvalidRequest(
                    "image", f"must be at least 64 px a side and at most 8:1, got {width}x{height}"
                )
        if request.edit is not None and request.edit.mask is not None:
            raise InvalidRequest("mask", f"a {self.name} model edits by reference: it takes no mask")

    def references(self, vae: nn.Module, request: Any, rows: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """Flux2Pipeline's condition images: each scaled to at most `edit_area`, cropped to a
        multiple of 16, VAE-encoded (its mode), patchified and normalized, packed, at time 10,
        20, ...; the same on every row."""
        if request.edit is None:
            return {}, ()
        processor, device = (
            Flux2ImageProcessor(vae_scale_factor=self.vae_scale_factor),
            next(vae.parameters()).device,
        )
        tokens, ids, layout = [], [], []
        for index, image in enumerate((request.edit.image, *request.edit.more)):
            width, height = edit_size(image.size, self.size_multiple, self.edit_area)
            if image.width * image.height > (self.edit_area or 0):
                image = Flux2ImageProcessor._resize_to_target_area(image, self.edit_area)
            pixels = processor.preprocess(image, height=height, width=width, resize_mode="crop")
            latents = self.scale_latents(vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode())
            _, channels, h, w = latents.shape
            tokens.append(latents.reshape(1, channels, h * w).permute(0, 2, 1))
            ids.append(image_positions(10 * (index + 1), h, w))
            layout.append((h, w))
        conditioning = {REFERENCES: torch.cat(tokens, dim=1), REFERENCE_IDS: torch.cat(ids)[None].float()}
        return {k: v.expand(rows, -1, -1) for k, v in conditioning.items()}, tuple(layout)

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        return {"guidance": torch.full((1,), request.guidance_scale)}  # per row: other scales share the call

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)

    def messages(self, prompt: str) -> list[dict[str, Any]]:
        """Flux2Pipeline's format_input for a text prompt."""
        text = prompt.replace("[IMG]", "")
        return [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
            {"role": "user", "content": [{"type": "text", "text": text}]},
        ]

    def tokens(self, tokenizer: Any, prompts: list[str]) -> Any:
        return tokenizer.apply_chat_template(
            [self.messages(p) for p in prompts],
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=TEXT_TOKENS,
        )

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """The templated prompts' hidden states at `hidden_layers`, side by side per token."""
        encoder = encoders[0]
        device = next(encoder.parameters()).device
        tokens = self.tokens(tokenizers[0], prompts)
        model = getattr(encoder, "model", encoder)  # without the LM head's logits
        states = model(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=tokens["attention_mask"].to(device),
            output_hidden_states=True,
            use_cache=False,
        ).hidden_states
        stacked = torch.stack([states[k] for k in self.hidden_layers], dim=2)  # [N, tokens, layers, dim]
        return TextEmbeddings(stacked.flatten(2))

    @property
    def vae_scale_factor(self) -> int:
        """Pixels a latent pixel (a token) spans: the VAE's 8 times the 2x2 patch."""
        return 2 * 2 ** (len(self.config.vae.get("block_out_channels", (0,) * 4)) - 1)

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor

    @property
    def latent_channels(self) -> int:
        return int(self.config.denoiser.get("in_channels", 128))  # patchified: 4 x the VAE's

    def set_timesteps(self, scheduler: Any, steps: int, device: torch.device, latent_shape: tuple) -> None:
        mu = empirical_mu(latent_shape[-2] * latent_shape[-1], steps)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=device, mu=mu)

    def attach(self, vae: nn.Module) -> None:
        """The VAE's batch-norm statistics, which normalize the latents: weights, not config."""
        eps = float(self.config.vae.get("batch_norm_eps", 1e-4))
        mean, var = (t.detach().to("cpu", torch.float32) for t in (vae.bn.running_mean, vae.bn.running_var))
        self.statistics = (mean, torch.sqrt(var + eps))

    def _stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch-norm mean and standard deviation per patchified channel, as `latents`."""
        mean, std = self.statistics
        return mean.view(1, -1, 1, 1).to(latents), std.view(1, -1, 1, 1).to(latents)

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Denormalized and unpatchified: [N, 32, 2h, 2w], as the VAE decodes them."""
        mean, std = self._stats(latents)
        latents = latents * std + mean
        n, c, h, w = latents.shape
        latents = latents.reshape(n, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
        return latents.reshape(n, c // 4, h * 2, w * 2)

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents patchified and normalized (Flux2Pipeline._encode_vae_image)."""
        n, c, h, w = latents.shape
        latents = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
        latents = latents.reshape(n, c * 4, h // 2, w // 2)
        mean, std = self._stats(latents)
        return (latents - mean) / std

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if not encoders:
            raise ModelFolderError(f"a {self.name} folder needs text_encoder and its tokenizer")
        width = int(encoders[0].config.get_text_config().hidden_size) * len(self.hidden_layers)
        if width != int(self.config.denoiser["joint_attention_dim"]):
            raise ModelFolderError(
                f"the transformer takes {self.config.denoiser['joint_attention_dim']} text features, "
                f"the text encoder's layers {self.hidden_layers} make {width}"
            )


class Flux2Klein(Flux2):
    """FLUX.2 [klein] (4 B, 9 B): Qwen3's layers 9, 18 and 27; no embedded guidance; classifier-free
    guidance against the empty prompt unless step-distilled (`is_distilled` in model_index.json:
    4 steps, guidance ignored)."""

    name: ClassVar[str] = "flux2-klein"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("Flux2KleinPipeline",)
    hidden_layers: ClassVar[tuple[int, ...]] = (9, 18, 27)
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        "flux2-klein-4b": {**KLEIN_4B, "guidance_embeds": False},
        "flux2-klein-9b": {**KLEIN_9B, "guidance_embeds": False},
    }

    @property
    def reference_parts(self) -> dict[str, Any]:  # type: ignore[override]
        """The 4 B's Qwen3-4B or the 9 B's Qwen3-8B: the one whose three layers make the context."""
        width = int(self.config.denoiser["joint_attention_dim"]) // len(self.hidden_layers)
        encoder = QWEN3_8B if width == QWEN3_8B["hidden_size"] else QWEN3_4B
        return {
            "text_encoder": lambda: Qwen3ForCausalLM(Qwen3Config(**encoder)),
            "vae": lambda: AutoencoderKLFlux2.from_config(FLUX2_VAE),
        }

    @property
    def distilled(self) -> bool:
        return bool(self.config.index.get("is_distilled", False))

    @property
    def default_steps(self) -> int:  # type: ignore[override]
        return 4 if self.distilled else 50  # the model cards'

    @property
    def default_guidance(self) -> float:  # type: ignore[override]
        return 1.0 if self.distilled else 4.0  # distilled: guidance has no effect

    def rows(self, request: GenerationRequest) -> int:
        return 1 if self.distilled else Family.rows(self, request)  # CFG when guidance_scale > 1

    lone_rows = 1  # the distilled klein people run

    def cfg_scale(self, request: GenerationRequest, expert: int = 0) -> float:
        return request.guidance_scale

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        return {}

    def tokens(self, tokenizer: Any, prompts: list[str]) -> Any:
        turns = [[{"role": "user", "content": p}] for p in prompts]
        texts = [
            tokenizer.apply_chat_template(
                turn, tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            for turn in turns
        ]
        return tokenizer(
            texts, return_tensors="pt", padding="max_length", truncation=True, max_length=TEXT_TOKENS
        )


def image_positions(time: int, h: int, w: int) -> torch.Tensor:
    """[h · w, 4] position ids (time, row, column, 0): Flux2Pipeline._prepare_image_ids."""
    rows, columns = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([torch.full_like(rows, time), rows, columns, torch.zeros_like(rows)], -1).reshape(
        -1, 4
    )
