"""LTX-2 text-to-video with sound (`LTX2Pipeline`): one transformer denoises a video and its
audio together (`server/engine/denoisers/ltx2.py`), each row both.

- **Prompts.** Gemma 3 reads each prompt padded on the left to 1024 tokens; every hidden state
  (the embeddings' and each layer's) is stacked per token and the text connectors
  (`connectors`: learnable registers in place of the padding, one stack for the video and one
  for the audio) turn them into the two streams' prompt tokens (their mask all ones).
- **Latents.** A row's latents are its video's packed tokens (the 32×-spatial, 8×-temporal
  VAE's latents, 1×1×1 patches: a clip of 1 + 8k frames is 1 + k latent frames) followed by
  its audio's (the audio VAE's latent steps, each its channels × mel bins), [1, tokens, C]:
  the two streams' channels are equal in every published LTX-2. The noise is drawn as the
  pipeline draws it: the video's [1, C, F, h, w], then the audio's [1, C_a, L, M], in float32.
  A clip of F frames at `fps` has round(F / fps × rate / hop / 4) audio latents: the frame
  rate sets the sound's length and the video's positions (its frames' times in seconds).
- **Schedule.** Flow matching's sigmas from 1 to 1/steps, shifted by `mu` from the video's
  token count, the same for both streams (the pipeline steps two copies of one scheduler).
- **Guidance**, as the pipeline does it on the predicted clean latents of each stream apart:
  classifier-free guidance (a negative row), spatio-temporal guidance (a row whose chosen
  blocks' self-attention is skipped), modality isolation (a row without audio↔video
  attention), each with its audio scale, then the guidance rescale of each. A request's rows
  are [negative, prompt, perturbed, isolated], those its scales turn on; they batch with other
  requests' rows (`server/engine/denoisers/ltx2.py`).
- **Decoding.** The video's latents denormalized by the VAE's per-channel statistics and
  decoded; the audio's denormalized by the audio VAE's, decoded to a mel spectrogram and turned
  into a waveform by the vocoder (`sound`), [channels, samples] at its output rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from PIL import Image
from torch import nn
from transformers import Gemma3TextConfig, Gemma3TextModel

from server.engine.denoisers.ltx2 import (
    AUDIO_CONTEXT,
    AUDIO_COORDS,
    ISOLATED,
    STG,
    TEXT_TOKENS,
    VIDEO_COORDS,
)
from server.errors import InvalidRequest, ModelFolderError
from server.pipeline.families.base import Family, TextEmbeddings
from server.pipeline.steps.schedulers import FLOW_FOLDER_SCHEDULERS
from server.requests.clip import Clip
from server.requests.generation import GenerationRequest
from server.requests.guidance import AudioVideoGuidance

MEL_COMPRESSION = 4  # the audio VAE's latents have a quarter of its mel bins
# LTX2Pipeline.__call__'s defaults: the video's CFG 3 (guidance_scale), the audio's 7; STG at 1
# on block 28; modality isolation at 3; both rescaled by 0.7.
DEFAULT_GUIDANCE = AudioVideoGuidance(
    audio_scale=7.0,
    stg_scale=1.0,
    audio_stg_scale=1.0,
    modality_scale=3.0,
    audio_modality_scale=3.0,
    rescale=0.7,
    audio_rescale=0.7,
    stg_blocks=(28,),
)
DEFAULT_FPS = 24.0  # LTX2Pipeline's frame_rate
# The scheduler's shift by the video's tokens, where its config names none (the pipeline's).
SHIFT_DEFAULTS = {
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "base_shift": 0.95,
    "max_shift": 2.05,
}
# For `plan --config`, as Lightricks/LTX-2 holds them: Gemma 3 12B's language model (its vision
# tower, which the pipeline never runs, left out), the connectors, both VAEs and the vocoder (their
# classes' defaults)
GEMMA3_12B_TEXT = {
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 262208,
}
# Lightricks/LTX-2's transformer (the class's defaults: 48 blocks, 19 B) and
# LTX-2.3's (22 B: gated attention, the prompt's modulation, perturbable self-attention).
LTX23 = {
    "gated_attn": True,
    "cross_attn_mod": True,
    "audio_gated_attn": True,
    "audio_cross_attn_mod": True,
    "use_prompt_embeddings": False,
    "perturbed_attn": True,
    "rope_type": "split",
}


class JointShape(tuple):
    """A row's latents' shape, (1, video tokens + audio tokens, C), that knows its parts: the
    video's (C, F, h, w) and the audio's (C_a, L, M)."""

    video: tuple[int, int, int, int]
    audio: tuple[int, int, int]

    def __new__(cls, video: tuple[int, int, int, int], audio: tuple[int, int, int]) -> JointShape:
        channels, frames, height, width = video
        shape = super().__new__(cls, (1, frames * height * width + audio[1], channels))
        shape.video, shape.audio = video, audio
        return shape

    @property
    def video_tokens(self) -> int:
        return self[1] - self.audio[1]


class LTX2(Family):
    name: ClassVar[str] = "ltx-2"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("LTX2Pipeline",)
    served: ClassVar[str] = "diffshard serves LTX-2's text-to-video with its sound"  # refusals say it
    denoiser: ClassVar[str] = "transformer"
    denoiser_class: ClassVar[type[nn.Module]] = LTX2VideoTransformer3DModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder", "connectors")
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer",)
    sound_parts: ClassVar[tuple[str, ...]] = ("audio_vae", "vocoder")
    schedulers: ClassVar[tuple[str, ...]] = ("default",)  # flow matching: the folder's own
    folder_schedulers: ClassVar[tuple[str, ...]] = FLOW_FOLDER_SCHEDULERS
    step_caches: ClassVar[tuple[str, ...]] = ("off", "first_block")
    keep_precise: ClassVar[tuple[str, ...]] = ("proj_out", "audio_proj_out")
    precise_rows: ClassVar[tuple[str, ...]] = (VIDEO_COORDS, AUDIO_COORDS)  # positions in seconds
    default_steps: ClassVar[int] = 30
    default_guidance: ClassVar[float] = 3.0
    reference_vae: ClassVar[dict[str, Any] | None] = {}  # AutoencoderKLLTX2Video's defaults
    reference_parts: ClassVar[dict[str, Any]] = {  # the published parts beside the transformer
        "text_encoder": lambda: Gemma3TextModel(Gemma3TextConfig(**GEMMA3_12B_TEXT)),
        "connectors": lambda: LTX2TextConnectors(),
        "vae": lambda: AutoencoderKLLTX2Video(),
        "audio_vae": lambda: AutoencoderKLLTX2Audio(),
        "vocoder": lambda: LTX2Vocoder(),
    }
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {"ltx-2": {}, "ltx-2.3": LTX23}

    def noise_dtype(self, dtype: torch.dtype, edit: bool) -> torch.dtype:
        return torch.float32  # LTX2Pipeline draws both streams' noise in float32

    # Rows: a request's passes.

    def guidance_of(self, request: GenerationRequest) -> AudioVideoGuidance:
        return (request.guidance or AudioVideoGuidance()).filled(DEFAULT_GUIDANCE)

    def passes(self, request: GenerationRequest) -> tuple[str, ...]:
        """The rows a step runs, in order: "negative" (CFG, when either stream's scale is past 1),
        "prompt", "perturbed" (STG, either scale past 0), "isolated" (either past 1)."""
        g = self.guidance_of(request)
        rows = ("negative",) if max(request.guidance_scale, g.audio_scale) > 1 else ()
        rows += ("prompt",)
        rows += ("perturbed",) if max(g.stg_scale, g.audio_stg_scale) > 0 else ()
        return rows + (("isolated",) if max(g.modality_scale, g.audio_modality_scale) > 1 else ())

    def rows(self, request: GenerationRequest) -> int:
        return len(self.passes(request))

    def negative_row(self, request: GenerationRequest) -> bool:
        return "negative" in self.passes(request)

    lone_rows = 4  # the default guidance runs all four passes

    def more_rows(self, own: TextEmbeddings, request: GenerationRequest) -> TextEmbeddings:
        """The prompt's embeddings again for the perturbed and isolated rows."""
        extra = self.rows(request) - own.context.shape[0]
        if extra == 0:
            return own
        last = own.context.shape[0] - 1
        pick = torch.tensor([*range(own.context.shape[0]), *[last] * extra])
        return TextEmbeddings(own.context[pick], None, {k: v[pick] for k, v in own.rows.items()})

    def references(self, vae: nn.Module, request: Any, rows: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """Each row's positions (the video's patches' and the audio's latents' bounds: the
        pipeline's `prepare_*_coords`), its STG mask and isolation flag; the layout: the video's
        latent size (rows of other sizes never share a call or a decode)."""
        shape = self.request_shape(request)
        (_, frames, height, width), (_, audio, _) = shape.video, shape.audio
        video_rope, audio_rope = self._ropes()
        fps = self.fps(request)
        passes = self.passes(request)
        blocks = self.config.denoiser.get("num_layers", 48)
        stg = torch.ones(rows, blocks)
        perturbed = [b for b in self.guidance_of(request).stg_blocks if 0 <= b < blocks]
        if "perturbed" in passes:
            stg[passes.index("perturbed"), perturbed] = 0
        isolated = torch.zeros(rows)
        if "isolated" in passes:
            isolated[passes.index("isolated")] = 1
        tensors = {
            VIDEO_COORDS: video_rope.prepare_video_coords(rows, frames, height, width, "cpu", fps=fps),
            AUDIO_COORDS: audio_rope.prepare_audio_coords(rows, audio, "cpu"),
            STG: stg,
            ISOLATED: isolated,
        }
        return tensors, (frames, height, width)

    def _ropes(self) -> tuple[nn.Module, nn.Module]:
        """The transformer's video and audio rotary modules (no weights), for their positions."""
        from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

        c = self.config.denoiser
        video = LTX2AudioVideoRotaryPosEmbed(
            dim=1,  # the positions do not depend on the width
            patch_size=c.get("patch_size", 1),
            patch_size_t=c.get("patch_size_t", 1),
            scale_factors=tuple(c.get("vae_scale_factors", (8, 32, 32))),
            causal_offset=c.get("causal_offset", 1),
            modality="video",
        )
        audio = LTX2AudioVideoRotaryPosEmbed(
            dim=1,
            patch_size=c.get("audio_patch_size", 1),
            patch_size_t=c.get("audio_patch_size_t", 1),
            sampling_rate=c.get("audio_sampling_rate", 16000),
            hop_length=c.get("audio_hop_length", 160),
            scale_factors=[c.get("audio_scale_factor", 4)],
            causal_offset=c.get("causal_offset", 1),
            modality="audio",
        )
        return video, audio

    def fps(self, request: GenerationRequest) -> float:
        return float(request.fps or DEFAULT_FPS)

    # Prompts → conditioning.

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        """LTX2Pipeline._get_gemma_prompt_embeds, then its connectors."""
        (gemma, connectors), tokenizer = encoders[:2], tokenizers[0]
        device = next(gemma.parameters()).device
        tokenizer.padding_side = "left"  # as the pipeline sets it: Gemma pads chat prompts on the left
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokens = tokenizer(
            [p.strip() for p in prompts],
            padding="max_length",
            max_length=TEXT_TOKENS,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        states = gemma(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        states = torch.stack(states, dim=-1).flatten(2, 3).to(gemma.dtype)
        video, audio, kept = connectors(states, mask, padding_side="left")
        if not bool(kept.all()):  # diffusers' connectors fill the padding: the blocks take no mask
            raise ValueError(
                "LTX-2's text connectors masked tokens: this diffusers release is not one served"
            )
        return TextEmbeddings(video, rows={AUDIO_CONTEXT: audio})

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(extras)

    # Latents and their schedule.

    def _compression(self, axis: str, patch: str) -> int:
        """The VAE's `axis` compression: its config's, else its patch × 2 per scaling block (as
        AutoencoderKLLTX2Video derives it)."""
        vae = self.config.vae
        if vae.get(axis) is not None:
            return int(vae[axis])
        return int(vae.get(patch, 1)) * 2 ** sum(vae.get("spatio_temporal_scaling", (True,) * 4))

    @property
    def vae_scale_factor(self) -> int:
        return self._compression("spatial_compression_ratio", "patch_size")

    @property
    def _temporal(self) -> int:
        return self._compression("temporal_compression_ratio", "patch_size_t")

    @property
    def latent_channels(self) -> int:
        return int(self.config.vae.get("latent_channels", self.config.denoiser["in_channels"]))

    @property
    def inpainting_channels(self) -> int:
        return 0

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * int(self.config.denoiser.get("patch_size", 1))

    @property
    def native_size(self) -> int:
        return 512  # the default clip's height (768×512)

    @property
    def clip(self) -> Clip:
        """LTX2Pipeline's default clip: 121 frames of 768×512 at 24 fps; 1 + 8k frames (the VAE's 8×)."""
        return Clip(frames=121, size=(768, 512), frame_multiple=self._temporal, fps=int(DEFAULT_FPS))

    @property
    def default_area(self) -> float:  # type: ignore[override]
        width, height = self.clip.size
        return width * height / self.native_size**2

    def latent_shape(self, width: int, height: int, frames: int | None = None) -> tuple[int, ...]:
        """The video's latents as its VAE decodes them, [1, C, F, h, w] (an image: one frame)."""
        scale = self.vae_scale_factor
        return (1, self.latent_channels, self.clip.latent(frames or 1), height // scale, width // scale)

    def request_shape(self, request: GenerationRequest) -> JointShape:
        """A row's latents: its video's, and its audio's for the clip's duration at its fps."""
        video = self.latent_shape(request.width, request.height, request.frames)[1:]
        c, sound = self.config.denoiser, self.config.parts.get("audio_vae", {})
        per_second = c.get("audio_sampling_rate", 16000) / c.get("audio_hop_length", 160)
        seconds = (request.frames or 1) / self.fps(request)
        steps = round(seconds * per_second / c.get("audio_scale_factor", 4))
        bins = int(sound.get("mel_bins", 64)) // MEL_COMPRESSION
        return JointShape(video, (int(sound.get("latent_channels", 8)), steps, bins))

    def set_timesteps(self, scheduler: Any, steps: int, device: torch.device, latent_shape: tuple) -> None:
        """The pipeline's sigmas from 1 to 1/steps, shifted by `mu` from the video's tokens."""
        config = scheduler.config
        mu = calculate_shift(
            latent_shape.video_tokens, *(config.get(k, v) for k, v in SHIFT_DEFAULTS.items())
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=device, mu=mu)

    def init_noise_sigma(self, scheduler: Any) -> float:
        return 1.0

    def model_input(self, scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return latents

    def combine(self, prediction: torch.Tensor, state: Any) -> torch.Tensor:
        """The pipeline's guidance of one step, on each stream's predicted clean latents apart:
        the prompt's, plus each pass's scaled difference from it, rescaled, back to a velocity."""
        request, g = state.request, self.guidance_of(state.request)
        sigma = state.scheduler.sigmas[state.begin + state.index]
        clean = {
            name: state.latents - v * sigma
            for name, v in zip(self.passes(request), prediction.split(1), strict=True)
        }
        video = self.request_shape(request).video_tokens
        scales = (
            (slice(None, video), request.guidance_scale, g.stg_scale, g.modality_scale, g.rescale),
            (slice(video, None), g.audio_scale, g.audio_stg_scale, g.audio_modality_scale, g.audio_rescale),
        )
        guided = torch.empty_like(state.latents)
        for part, cfg, stg, modality, rescale in scales:
            prompt = clean["prompt"][:, part]
            value = prompt
            if "negative" in clean:
                value = value + (cfg - 1) * (prompt - clean["negative"][:, part])
            if "perturbed" in clean:
                value = value + stg * (prompt - clean["perturbed"][:, part])
            if "isolated" in clean:
                value = value + (modality - 1) * (prompt - clean["isolated"][:, part])
            guided[:, part] = rescale_noise_cfg(value, prompt, rescale) if rescale > 0 else value
        return (state.latents - guided) / sigma

    def draw_noise(self, noise: torch.Tensor, generator: torch.Generator, shape: tuple) -> None:
        """The video's noise [1, C, F, h, w], then the audio's [1, C_a, L, M], each packed."""
        video = torch.randn((1, *shape.video), generator=generator, dtype=noise.dtype)
        audio = torch.randn((1, *shape.audio), generator=generator, dtype=noise.dtype)
        noise.copy_(torch.cat([pack_video(video), pack_audio(audio)], dim=1))

    # Image-to-video: a first frame held still (LTX2ImageToVideoPipeline), optional here.

    @property
    def pastes_first_frame(self) -> bool:
        return True  # the published folder serves LTX2ImageToVideoPipeline from the same parts

    still_every_step: ClassVar[bool] = True  # the pipeline steps the other frames only, each step

    def still_columns(self, latent_shape: tuple[int, ...]) -> int:
        return latent_shape[1]  # a timestep a token: the first frame's 0

    def hold_first_frame(
        self, latents: torch.Tensor, first_frame: torch.Tensor, timesteps: torch.Tensor | None = None
    ) -> None:
        """The first latent frame's tokens (the row's first h·w) are the frame's, at timestep 0."""
        tokens = first_frame.shape[1]
        latents[:, :tokens] = first_frame
        if timesteps is not None:
            timesteps[:, :tokens] = 0.0

    frame_resample: ClassVar[str] = "bilinear"  # LTX2ImageToVideoPipeline's video processor's

    def conditioning_frame(self, image: Any) -> Any:
        """The frame re-compressed as one H.264 frame at CRF 33, as the pipeline does by default
        for Gemma-3 models (they trained on compressed frames), at its own size (resized after)."""
        from diffusers.pipelines.ltx2.utils import DEFAULT_IMAGE_CRF, apply_image_conditioning_crf

        return Image.fromarray(
            apply_image_conditioning_crf(np.array(image.convert("RGB")), DEFAULT_IMAGE_CRF)
        )

    def first_frame(self, vae: nn.Module, pixels: torch.Tensor, frames: int) -> torch.Tensor:
        """The frame's latents (its posterior's mode), normalized by the VAE's statistics and
        packed: [1, h·w, C] float32 (the pipeline's prepare_latents)."""
        vae_device = next(vae.parameters()).device
        latents = (
            vae.encode(pixels[:, :, None].to(vae_device, vae.dtype)).latent_dist.mode().to(torch.float32)
        )
        mean, std = (t.view(1, -1, 1, 1, 1).to(latents.device) for t in self.statistics)
        return pack_video((latents - mean) * 1.0 / std)

    # Latents → video and sound.

    def attach(self, vae: nn.Module) -> None:
        """The VAE's per-channel statistics, which normalize the video's latents: weights."""
        self.statistics = tuple(
            t.detach().to("cpu", torch.float32) for t in (vae.latents_mean, vae.latents_std)
        )

    def decoded_latents(self, latents: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
        """The video's tokens unpacked to [N, C, F, h, w] and denormalized (the pipeline's
        `_unpack_latents`, `_denormalize_latents`)."""
        shape = self.request_shape(request)
        channels, frames, height, width = shape.video
        video = latents[:, : shape.video_tokens].transpose(1, 2)
        video = video.reshape(latents.shape[0], channels, frames, height, width)
        mean, std = (t.view(1, -1, 1, 1, 1).to(video) for t in self.statistics)
        return video * std / float(self.config.vae.get("scaling_factor", 1.0)) + mean

    def sound(
        self, parts: Sequence[nn.Module], latents: torch.Tensor, request: GenerationRequest
    ) -> torch.Tensor:
        """The audio's tokens denormalized by the audio VAE's statistics, unpacked to [N, C, L, M],
        decoded to mel spectrograms and voiced by the vocoder: [N, channels, samples]."""
        audio_vae, vocoder = parts
        shape = self.request_shape(request)
        channels, _, bins = shape.audio
        audio = latents[:, shape.video_tokens :]
        audio = audio * audio_vae.latents_std.to(audio) + audio_vae.latents_mean.to(audio)
        audio = audio.unflatten(2, (channels, bins)).transpose(1, 2).to(audio_vae.dtype)
        return vocoder(audio_vae.decode(audio, return_dict=False)[0])

    def sample_rate(self) -> int:
        """The waveform's samples a second (the vocoder's output rate)."""
        vocoder = self.config.parts.get("vocoder", {})
        return int(vocoder.get("output_sampling_rate", vocoder.get("output_sample_rate", 24000)))

    # What a folder must hold.

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        if len(encoders) < 2:
            raise ModelFolderError(
                "an LTX-2 folder needs text_encoder (Gemma 3), its tokenizer and connectors"
            )

    def check_configs(self, where: str) -> None:
        super().check_configs(where)
        c = self.config.denoiser
        video, audio = int(c["in_channels"]), int(c.get("audio_in_channels", 128))
        if video != audio or int(c.get("out_channels") or video) != int(c.get("audio_out_channels") or audio):
            raise ModelFolderError(
                f"{where}/transformer/config.json's video and audio streams have {video} and {audio} "
                f"channels; diffshard steps them as one tensor, which every published LTX-2 allows (128 each)"
            )
        for part in self.sound_parts:
            if part not in self.config.parts:
                raise ModelFolderError(f"{where}/model_index.json lists no {part}: an LTX-2 folder needs one")
        sound = self.config.parts["audio_vae"]
        packed = int(sound.get("latent_channels", 8)) * (int(sound.get("mel_bins", 64)) // MEL_COMPRESSION)
        if packed != audio:
            raise ModelFolderError(
                f"{where}/audio_vae's latents pack to {packed} channels; "
                f"the transformer's audio takes {audio}"
            )

    def check_request(self, request: Any) -> None:
        if request.steps < 2:  # its scheduler's terminal shift makes one step's sigma 0 / 0
            raise InvalidRequest("steps", "must be at least 2 for an LTX-2 model")
        g = request.guidance
        blocks = int(self.config.denoiser.get("num_layers", 48))
        if g is not None and g.stg_blocks is not None and any(not 0 <= b < blocks for b in g.stg_blocks):
            raise InvalidRequest("guidance.stg_blocks", f"must name blocks from 0 to {blocks - 1}")


def pack_video(latents: torch.Tensor) -> torch.Tensor:
    """[N, C, F, h, w] → [N, F·h·w, C] (LTX2Pipeline._pack_latents over 1×1×1 patches)."""
    return latents.flatten(2).transpose(1, 2)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """[N, C, L, M] → [N, L, C·M] (LTX2Pipeline._pack_audio_latents)."""
    return latents.transpose(1, 2).flatten(2, 3)


class LTX2I2V(LTX2):
    """A folder saved as `LTX2ImageToVideoPipeline`: LTX-2 whose every request starts from its
    first frame (`input_reference`), the same parts as text-to-video's."""

    pipeline_classes: ClassVar[tuple[str, ...]] = ("LTX2ImageToVideoPipeline",)
    takes_reference: ClassVar[bool] = True
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {}
