"""Wan 2.1 text-to-video (`WanPipeline`): a video transformer over 1×2×2 patches of every latent
frame (`server/engine/denoisers/wan.py`), UMT5's tokens (each prompt's own, zero-padded to 512),
classifier-free guidance as two rows, a flow-matching schedule, and a causal 3D VAE (8× spatial,
4× temporal: a video of 1 + 4k frames is 1 + k latent frames) whose latents are normalized by
per-channel means and standard deviations.

A video is one row (two when guided): its frames are latent frames of that row, so videos at
different steps batch the way images do. An image (a request with no frames: the Images API) is
a one-frame video, as WanPipeline makes it with num_frames=1."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from server.engine.denoisers.wan import UMT5_TOKENS
from server.errors import InvalidRequest, ModelFolderError
from server.pipeline.families.base import Family, TextEmbeddings
from server.pipeline.steps.schedulers import FLOW_FOLDER_SCHEDULERS
from server.requests.clip import Clip
from server.requests.generation import GenerationRequest

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers and -14B-Diffusers, transformer/config.json (14B: the class's
# defaults), text_encoder/config.json (UMT5-XXL's encoder) and vae/config.json (the defaults).
WAN_1_3B = {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
UMT5_XXL_ENCODER = {
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "vocab_size": 256384,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
    "tie_word_embeddings": False,
}
WAN_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "temperal_downsample": [False, True, True]}
# Wan-AI/Wan2.2-TI2V-5B-Diffusers (diffusers' scripts/convert_wan_to_diffusers.py): a 5 B transformer
# over the Wan 2.2 VAE's 48 channels, 16x spatial (2x2 patches inside the VAE)
WAN22_TI2V_5B = {
    "num_attention_heads": 24,
    "ffn_dim": 14336,
    "num_layers": 30,
    "in_channels": 48,
    "out_channels": 48,
}
# Wan-AI/Wan2.2-T2V-A14B-Diffusers and -I2V-A14B-Diffusers: two experts of Wan 2.1 14B's shape
# (the class's defaults; I2V's take 36 channels, no CLIP), switching at boundary_ratio
TWO_EXPERTS = {"transformer": ["diffusers", "WanTransformer3DModel"]}
TWO_EXPERTS["transformer_2"] = TWO_EXPERTS["transformer"]
WAN22_T2V_A14B = {"_index": {**TWO_EXPERTS, "boundary_ratio": 0.875}}
WAN22_I2V_A14B = {"in_channels": 36, "_index": {**TWO_EXPERTS, "boundary_ratio": 0.9}}
WAN22_VAE = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
}


def prompt_clean(text: str) -> str:
    """WanPipeline's cleaning: HTML entities undone, whitespace collapsed (ftfy is not installed)."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


class Wan(Family):
    name: ClassVar[str] = "wan"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("WanPipeline",)
    # refusals say it
    served: ClassVar[str] = "diffshard serves Wan 2.1's and Wan 2.2's text-to-video (A14B, TI2V-5B)"
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = WanTransformer3DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder",)
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer",)
    schedulers: ClassVar[tuple[str, ...]] = ("default",)  # flow matching: the folder's own
    # its published folders' UniPC (flow_prediction, flow sigmas), or flow matching's Euler
    folder_schedulers: ClassVar[tuple[str, ...]] = ("UniPCMultistepScheduler", *FLOW_FOLDER_SCHEDULERS)
    step_caches: ClassVar[tuple[str, ...]] = ("off", "first_block")
    keep_precise: ClassVar[tuple[str, ...]] = ("proj_out",)  # the output head, as for the other DiTs
    default_steps: ClassVar[int] = 50
    default_guidance: ClassVar[float] = 5.0
    vae_float32: ClassVar[bool] = True  # as diffusers' and Wan-AI's examples load it: 0.5 GB
    reference_vae: ClassVar[dict[str, Any] | None] = WAN_VAE
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        "wan-1.3b": WAN_1_3B,
        "wan-14b": {},
        "wan2.2-ti2v-5b": {**WAN22_TI2V_5B, "_vae": WAN22_VAE, "_index": {"expand_timesteps": True}},
        "wan2.2-t2v-a14b": WAN22_T2V_A14B,
    }

    def noise_dtype(self, dtype: torch.dtype, edit: bool) -> torch.dtype:
        return torch.float32  # every Wan pipeline of diffusers draws its noise in float32

    @property
    def reference_parts(self) -> dict[str, Any]:  # type: ignore[override]
        """UMT5-XXL and the VAE of the planned config (Wan 2.1's, or Wan 2.2's for TI2V-5B)."""
        vae = {k: v for k, v in self.config.vae.items() if not k.startswith("_")}
        return {
            "text_encoder": lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL_ENCODER)),
            "vae": lambda: AutoencoderKLWan.from_config(vae),
        }

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """WanPipeline._get_t5_prompt_embeds: each prompt's own tokens, zeros after them."""
        encoder = encoders[0]
        device = next(encoder.parameters()).device
        tokens = tokenizers[0](
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=UMT5_TOKENS,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask
        states = encoder(tokens.input_ids.to(device), mask.to(device)).last_hidden_state
        keep = mask.gt(0).to(device)[..., None]  # each prompt's own tokens
        return TextEmbeddings(states * keep)

    @property
    def _temporal(self) -> tuple[bool, ...]:
        return tuple(self.config.vae.get("temperal_downsample", (False, True, True)))

    @property
    def vae_scale_factor(self) -> int:
        """8; Wan 2.2's VAE (TI2V-5B: 48 channels, 2x2 patches inside) says 16 in its config."""
        return int(self.config.vae.get("scale_factor_spatial") or 2 ** len(self._temporal))

    @property
    def clip(self) -> Clip:
        """WanPipeline's default clip, 81 frames of 832×480 (480p; TI2V-5B's model card: 121 of
        1280×704, 720p); 1 + 4k frames (the VAE's 4× temporal compression), as many as the
        transformer's rotary positions reach."""
        multiple = int(self.config.vae.get("scale_factor_temporal") or 2 ** sum(self._temporal))
        patch_frames = int(self.config.denoiser.get("patch_size", (1, 2, 2))[0])
        longest = (self._positions // patch_frames - 1) * multiple + 1
        frames, size = (121, (1280, 704)) if self.pastes_first_frame else (81, (832, 480))
        return Clip(frames=frames, size=size, frame_multiple=multiple, max_frames=longest)

    @property
    def default_area(self) -> float:  # type: ignore[override]
        """The default clip's pixels either way round (832x480 or 480x832; TI2V's 1280x704)."""
        width, height = self.clip.size
        return width * height / self.native_size**2

    @property
    def latent_channels(self) -> int:
        return int(self.config.vae.get("z_dim", self.config.denoiser["in_channels"]))

    @property
    def native_size(self) -> int:
        """Wan 2.1's 480p (TI2V-5B's 704): an image's side; a video's default is its clip's size."""
        return 704 if self.pastes_first_frame else 480

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * int(self.config.denoiser.get("patch_size", (1, 2, 2))[-1])

    @property
    def _positions(self) -> int:
        """Rotary positions the transformer has along each axis: past them its RoPE has none."""
        return int(self.config.denoiser.get("rope_max_seq_len", 1024))

    @property
    def max_size(self) -> int | None:
        return self._positions * self.size_multiple  # a position a patch

    def latent_shape(self, width: int, height: int, frames: int | None = None) -> tuple[int, ...]:
        """A video's latents; an image's (`frames` None) are a one-frame video's, as Wan draws them."""
        scale = self.vae_scale_factor
        return (1, self.latent_channels, self.clip.latent(frames or 1), height // scale, width // scale)

    def init_noise_sigma(self, scheduler: Any) -> float:
        return 1.0  # flow matching starts from pure noise

    def model_input(self, scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return latents

    def _stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vae, shape = self.config.vae, (1, self.latent_channels, 1, 1, 1)
        mean = torch.tensor(vae["latents_mean"], device=latents.device).view(shape).to(latents.dtype)
        std = torch.tensor(vae["latents_std"], device=latents.device).view(shape).to(latents.dtype)
        return mean, std

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return latents * std + mean

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return (latents - mean) / std

    @property
    def pastes_first_frame(self) -> bool:
        """Wan 2.2 TI2V-5B (`expand_timesteps`): a video may start from an image, whose latents
        stand in for the first latent frame at every step, its tokens at timestep 0."""
        return bool(self.config.index.get("expand_timesteps"))

    def first_frame(self, vae: nn.Module, pixels: torch.Tensor, frames: int) -> torch.Tensor:
        """WanImageToVideoPipeline.prepare_latents with expand_timesteps: the image alone as a
        one-frame video, encoded (its posterior's mode) and normalized: [1, C, 1, h, w] float32."""
        vae_device = next(vae.parameters()).device
        video = pixels[:, :, None].to(vae_device, vae.dtype)
        latents = vae.encode(video).latent_dist.mode().to(torch.float32)
        mean, std = self._stats(latents)
        return (latents - mean) * (1.0 / std)

    @property
    def experts(self) -> tuple[str, ...]:
        """Wan 2.2 A14B's two experts: `transformer` while t ≥ boundary_ratio × the scheduler's
        training timesteps (high noise), `transformer_2` below (low noise), as WanPipeline runs them."""
        two = (self.config.index.get("transformer_2") or [None])[0] is not None
        return ("transformer", "transformer_2") if two else ("transformer",)

    def expert(self, scheduler: Any, timestep: torch.Tensor) -> int:
        ratio = self.config.index.get("boundary_ratio")
        if ratio is None or len(self.experts) == 1:
            return 0
        return int(float(timestep) < ratio * scheduler.config.num_train_timesteps)

    def cfg_scale(self, request: GenerationRequest, expert: int = 0) -> float:
        """The low-noise expert's rows take `guidance_scale_2` (unset: `guidance_scale`)."""
        second = request.guidance_scale_2
        return second if expert == 1 and second is not None else request.guidance_scale

    def check_request(self, request: Any) -> None:
        second = request.guidance_scale_2
        if second is not None and len(self.experts) == 1:
            raise InvalidRequest(
                "guidance_scale_2", "is the low-noise expert's scale: this model has one transformer"
            )

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        """Two experts need their boundary and a boundary needs the second expert (WanPipeline
        would run none or ignore one). TI2V-5B (`expand_timesteps`) serves both ways from its
        WanPipeline folder (`pastes_first_frame`); in text-to-video its per-token timesteps are all
        the step's, so each row's one timestep gives WanPipeline's video."""
        if not encoders:
            raise ModelFolderError("a Wan folder needs text_encoder (UMT5) and its tokenizer")
        index = self.config.index
        two, ratio = len(self.experts) == 2, index.get("boundary_ratio")
        if two != (ratio is not None):
            raise ModelFolderError(
                "this folder has transformer_2 but no boundary_ratio in model_index.json (or the "
                "reverse): Wan 2.2's two experts need both"
            )
        if ratio is not None and not 0 < ratio < 1:
            raise ModelFolderError(f"model_index.json's boundary_ratio must be between 0 and 1, got {ratio}")
        if index.get("expand_timesteps") and self.takes_reference:
            raise ModelFolderError(
                "this folder's timesteps are per token (Wan 2.2 TI2V, expand_timesteps): serve it as "
                "WanPipeline (its published model_index.json), which takes input_reference too"
            )


class WanI2V(Wan):
    """Wan 2.1 image-to-video (`WanImageToVideoPipeline`): Wan's text-to-video conditioned on a
    first frame twice, as the pipeline does it. CLIP's vision encoder (`image_encoder`: its
    penultimate hidden states, 257 tokens for ViT-H/14) gives `encoder_hidden_states_image`, which
    the transformer projects (`image_dim`) and attends to beside the text (`added_kv_proj_dim`):
    a per-row extra, the same on the negative row. The frame itself, resized to the video's size,
    followed by black frames, is encoded by the VAE (its posterior's mode) and normalized: 16
    channels beside a 4-channel mask (1 on the first frame's 4 temporal slots, 0 after) make the
    20 channels concatenated to the noise at every step (`in_channels` 36), as an inpainting
    UNet's are (`RequestState.conditioning`). Every request needs its frame (`reference`).

    Refused at load beside Wan 2.2's (`Wan.check`): first-last-frame's paired image tokens
    (`pos_embed_seq_len`)."""

    pipeline_classes: ClassVar[tuple[str, ...]] = ("WanImageToVideoPipeline",)
    served: ClassVar[str] = (
        "diffshard serves Wan 2.1's image-to-video (a CLIP encoder) and Wan 2.2 I2V-A14B's"
    )
    image_encoders: ClassVar[tuple[str, ...]] = ("image_encoder",)
    processors: ClassVar[tuple[str, ...]] = ("image_processor",)
    takes_reference: ClassVar[bool] = True
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"wan2.2-i2v-a14b": WAN22_I2V_A14B}

    @property
    def inpainting_channels(self) -> int:
        return 0  # its extra channels are the first frame's (`first_frame`), not an inpainting's

    def first_frame(self, vae: nn.Module, pixels: torch.Tensor, frames: int) -> torch.Tensor:
        """WanImageToVideoPipeline.prepare_latents' condition for one video: [1, 4 + C, latent
        frames, h, w] in float32 from `pixels` [1, 3, H, W] in [-1, 1] (the frame, resized)."""
        every, (height, width) = self.clip.frame_multiple, pixels.shape[-2:]
        video = torch.cat([pixels[:, :, None], pixels.new_zeros(1, 3, frames - 1, height, width)], dim=2)
        vae_device = next(vae.parameters()).device
        latents = vae.encode(video.to(vae_device, vae.dtype)).latent_dist.mode().to(torch.float32)
        mean, std = self._stats(latents)
        latents = (latents - mean) * (1.0 / std)  # as the pipeline normalizes (its reciprocal)
        h, w = latents.shape[-2:]
        mask = torch.ones(1, 1, frames, h, w)
        mask[:, :, 1:] = 0
        mask = torch.cat([mask[:, :, :1].repeat_interleave(every, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, every, h, w).transpose(1, 2)
        return torch.cat([mask.to(latents.device), latents], dim=1)

    def encode_images(self, encoder: nn.Module, processor: Any, images: list[Any]) -> torch.Tensor:
        """WanImageToVideoPipeline.encode_image for each image: CLIP's penultimate hidden states."""
        device = next(encoder.parameters()).device
        pixels = processor(images=images, return_tensors="pt").pixel_values.to(device, encoder.dtype)
        return encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)  # encoder_hidden_states_image

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        super().check(encoders, denoiser)
        index, config, served = self.config.index, self.config.denoiser, self.served
        if (config.get("image_dim") is None) != ((index.get("image_encoder") or [None])[0] is None):
            raise ModelFolderError(
                f"this folder's transformer takes image tokens (image_dim) without an image encoder, "
                f"or the reverse: Wan 2.1 I2V has both, Wan 2.2 I2V-A14B neither; {served}"
            )
        if config.get("pos_embed_seq_len") is not None:
            raise ModelFolderError(f"this folder pairs first and last frames (FLF2V); {served}")
        wanted = 2 * self.latent_channels + self.clip.frame_multiple
        if int(config["in_channels"]) != wanted:
            raise ModelFolderError(
                f"an image-to-video transformer takes {wanted} input channels (noise, mask, first "
                f"frame), this one {config['in_channels']}"
            )
