"""What a model family declares: how prompts become the denoiser's conditioning, how latents are
shaped, scheduled and decoded. The pipeline runs any family the same way; only the family knows
its text encoders, extra conditioning rows and latent scaling.

A family reads a folder's configs (`ModelConfig`), never its weights: the planner uses the same
family object before anything loads. The weighted parts (encoders, tokenizers, VAE) are passed
in by the pipeline that loaded them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from diffusers import UNet2DConditionModel
from diffusers.image_processor import VaeImageProcessor
from torch import nn

from server.engine.denoisers.blocks import TEXT_MASK
from server.errors import ModelFolderError
from server.pipeline.steps.schedulers import DDPM_FOLDER_SCHEDULERS, SCHEDULER_NAMES
from server.requests.clip import Clip
from server.requests.generation import GenerationRequest

# SD-style families run every scheduler in steps/schedulers.py, beside "default" (the folder's own).
DDPM_SCHEDULERS = SCHEDULER_NAMES


@dataclass(frozen=True)
class ModelConfig:
    """A folder's configs, read without loading a weight: model_index.json and each part's config."""

    index: dict[str, Any]
    denoiser: dict[str, Any]
    vae: dict[str, Any] = field(default_factory=dict)
    guider: dict[str, Any] = field(default_factory=dict)  # a pipeline's guider (newer ones have one)
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)  # its `sound_parts`' configs


@dataclass
class TextEmbeddings:
    context: torch.Tensor  # [N, tokens, dim]: what the denoiser attends to
    pooled: torch.Tensor | None = None  # [N, dim]: one vector per prompt, for families that take one
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # other per-prompt inputs (a text mask)

    def take(self, start: int, count: int, zero_negative: bool = False) -> TextEmbeddings:
        """One request's `count` prompts from `start`; `zero_negative`: a row of zeros first (an
        unset negative prompt that conditions on zeros)."""

        def cut(rows: torch.Tensor) -> torch.Tensor:
            rows = rows[start : start + count]
            return torch.cat([torch.zeros_like(rows), rows]) if zero_negative else rows

        pooled = None if self.pooled is None else cut(self.pooled)
        return TextEmbeddings(cut(self.context), pooled, {k: cut(v) for k, v in self.rows.items()})


class Family:
    """SD 1.x/2.x, the base every family refines: one CLIP encoder's last hidden state, a UNet,
    a VAE scaled by `scaling_factor`. Subclasses override what differs."""

    name: ClassVar[str] = "sd"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("StableDiffusionPipeline",)
    denoiser: ClassVar[str] = "unet"  # the folder's part the ModelShard splits
    denoiser_class: ClassVar[type[nn.Module]] = UNet2DConditionModel
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder",)
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer",)
    image_encoders: ClassVar[tuple[str, ...]] = ()  # image-to-video's image encoder (weighted)
    processors: ClassVar[tuple[str, ...]] = ()  # and its image processor
    sound_parts: ClassVar[tuple[str, ...]] = ()  # what turns its audio latents into sound (LTX-2's)
    # per-row extras kept in float32 whatever the model's dtype: positions, which bfloat16 would move
    precise_rows: ClassVar[tuple[str, ...]] = ()
    takes_reference: ClassVar[bool] = False  # every request starts from an image (its first frame)
    # an edit's images condition every step (FLUX.2, Qwen-Image-Edit: their tokens join the
    # sequence) instead of starting the latents (img2img, inpainting): no mask, no strength
    edits_by_reference: ClassVar[bool] = False
    sees_images: ClassVar[bool] = False  # its text encoder reads an edit's images with the prompt
    edit_area: ClassVar[int | None] = None  # an edit's default size: its image's, scaled down to this area
    schedulers: ClassVar[tuple[str, ...]] = DDPM_SCHEDULERS
    folder_schedulers: ClassVar[tuple[str, ...]] = DDPM_FOLDER_SCHEDULERS  # the classes its folder may ship
    default_steps: ClassVar[int] = 50
    default_guidance: ClassVar[float] = 7.5
    takes_guidance: ClassVar[bool] = True  # guidance_scale means something (Qwen-Image: true CFG only)
    takes_true_cfg: ClassVar[bool] = False  # guidance-distilled models: true CFG is a second scale
    default_true_cfg: ClassVar[float] = 1.0  # its scale when a request sets none (1: off)
    step_caches: ClassVar[tuple[str, ...]] = ("off", "deep")  # step-caching policies (requests/step_cache.py)
    controlnets: ClassVar[tuple[str, ...]] = ()  # the ControlNet classes it takes (controlnets.py)
    # its ControlNet pipeline runs the net on the positive row only, and adds that to the negative's
    control_on_positive: ClassVar[bool] = False
    # Linear layers --quantize leaves in the model's dtype, named from the denoiser's root: none
    # in a UNet, whose first and last layers are convolutions (which no mode converts)
    keep_precise: ClassVar[tuple[str, ...]] = ()
    default_area: ClassVar[float] = 4.0  # the default pixel limit, in native areas (--max-pixels)
    # `plan --config`'s other parts, built on the meta device to count their bytes: name → a
    # builder; a family without them plans its denoiser alone
    reference_parts: ClassVar[dict[str, Any]] = {}
    reference_vae: ClassVar[dict[str, Any] | None] = None  # its VAE's config, if not SD's 8x one
    # Architectures `python -m server plan --config NAME` can plan: the reference checkpoints'
    # denoiser configs, trimmed to what differs from the class defaults.
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    @property
    def weighted(self) -> tuple[str, ...]:
        """The folder's parts that hold weights (safetensors only)."""
        return (*self.experts, "vae", *self.text_encoders, *self.image_encoders, *self.sound_parts)

    @property
    def experts(self) -> tuple[str, ...]:
        """The denoisers, in the order steps run them: one for most families; Wan 2.2 A14B's two
        (`transformer` for high noise, then `transformer_2`), both placed as the plan says."""
        return (self.denoiser,)

    def expert(self, scheduler: Any, timestep: torch.Tensor) -> int:
        """Which of `experts` denoises a row at `timestep` (its scheduler's)."""
        return 0

    # 1. Prompts → conditioning.

    def rows(self, request: GenerationRequest) -> int:
        """Denoiser rows one image takes: classifier-free guidance adds a negative row."""
        return 2 if request.guidance_scale > 1 else 1

    def negative_row(self, request: GenerationRequest) -> bool:
        """Whether its rows start with a negative prompt's (classifier-free guidance)."""
        return self.rows(request) == 2

    def more_rows(self, own: TextEmbeddings, request: GenerationRequest) -> TextEmbeddings:
        """A request's embeddings for all its rows, from its prompts' (negative first): the same
        for most; LTX-2's guidance passes repeat the prompt's."""
        return own

    lone_rows = 2  # a typical lone image's rows (guided), as the planner predicts it
    vae_float32: ClassVar[bool] = False  # its VAE in float32 whatever --dtype (Wan: as diffusers loads it)

    def cfg_scale(self, request: GenerationRequest, expert: int = 0) -> float:
        """The classifier-free guidance scale between a request's negative and positive rows
        (`expert`: the denoiser that made them, `experts`' index)."""
        return request.guidance_scale

    def guide(
        self, negative: torch.Tensor, positive: torch.Tensor, request: GenerationRequest, expert: int = 0
    ) -> torch.Tensor:
        """One prediction from a guided request's two rows' (classifier-free guidance)."""
        return negative + self.cfg_scale(request, expert) * (positive - negative)

    def combine(self, prediction: torch.Tensor, state: Any) -> torch.Tensor:
        """One prediction [1, ...] from a request's rows' (`state`: its RequestState)."""
        if state.rows == 2:  # classifier-free guidance: negative row, then prompt row
            return self.guide(*prediction.chunk(2), state.request, state.expert)
        return prediction

    @property
    def zero_unset_negative(self) -> bool:
        """Whether an unset negative prompt conditions on zeros instead of on ""."""
        return False

    def encode(
        self, encoders: Sequence[nn.Module], tokenizers: Sequence[Any], prompts: list[str]
    ) -> TextEmbeddings:
        encoder, device = encoders[0], _device(encoders[0])
        tokens = tokenize(tokenizers[0], prompts)
        # as diffusers: the attention mask only for encoders configured to use one
        use_mask = getattr(encoder.config, "use_attention_mask", False)
        mask = tokens.attention_mask.to(device) if use_mask else None
        return TextEmbeddings(encoder(tokens.input_ids.to(device), attention_mask=mask)[0])

    def extras(self, pooled: torch.Tensor | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
        """Per-row conditioning beside the context (rows as `pooled`'s), e.g. SDXL's time ids."""
        return {}

    def model_kwargs(self, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The batched extras as keyword arguments of the denoiser's forward."""
        return {}

    def edit_size(self, edit: Any) -> tuple[int, int]:
        """An edit's default (width, height): its image's (scaled down to `edit_area`), to a multiple."""
        return edit_size(edit.image.size, self.size_multiple, self.edit_area)

    def edit_crop(self, edit: Any) -> tuple[int, int, int, int] | None:
        """Where an edit sized by its default is made larger than its output (a padded canvas),
        the output's box in it (left, top, right, bottom); None: the whole."""
        return None

    def check_request(self, request: Any) -> None:
        """What this family refuses in a resolved request beyond the shared checks (raise InvalidRequest)."""

    def images_seen(self, request: Any) -> tuple[Any, ...]:
        """An edit's images as its text encoder reads them beside the prompt (`sees_images`)."""
        return request.edit.images if request.edit is not None else ()

    def references(self, vae: nn.Module, request: Any, rows: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """A request's conditioning from its edit's images, for families that edit by reference:
        per-row tensors ([rows, ...] each) and the layout their positions depend on (requests of
        other layouts never share a call)."""
        return {}, ()

    def encode_images(self, encoder: nn.Module, processor: Any, images: list[Any]) -> torch.Tensor:
        """Image-to-video: the image encoder's tokens [N, T, D] for each first frame."""
        raise NotImplementedError(f"a {self.name} model takes no image")

    def noise_dtype(self, dtype: torch.dtype, edit: bool) -> torch.dtype:
        """The dtype its diffusers pipeline draws the first noise in (`dtype`: the model's, its
        prompt embeddings'). Drawn so, a seed makes diffusers' image on every torch release: one
        release's bfloat16 draw need not equal another's, nor float32's rounded."""
        return dtype

    @property
    def pastes_first_frame(self) -> bool:
        """Whether a first frame, optional, is pasted over the first latent frame at every step
        (`first_frame` gives its latents) instead of conditioning beside the noise."""
        return False

    frame_resample: ClassVar[str] = "lanczos"  # how its image-to-video pipeline resizes a first frame

    def conditioning_frame(self, image: Any) -> Any:
        """A first frame as its pipeline conditions on it, before resizing (as it is, for most)."""
        return image

    # a still first frame pasted back over the latents after every step (LTX-2's), not at the end only
    still_every_step: ClassVar[bool] = False

    def still_columns(self, latent_shape: tuple[int, ...]) -> int:
        """A row's timesteps when its first frame is still: one a latent frame (Wan 2.2 TI2V's)."""
        return latent_shape[2]

    def hold_first_frame(
        self, latents: torch.Tensor, first_frame: torch.Tensor, timesteps: torch.Tensor | None = None
    ) -> None:
        """`first_frame` over the first latent frame of `latents` [rows, C, F, h, w], and its
        timesteps (`timesteps` [rows, F], if given) 0: a still frame's tokens are clean."""
        latents[:, :, :1] = first_frame
        if timesteps is not None:
            timesteps[:, 0] = 0.0

    def first_frame(self, vae: nn.Module, pixels: torch.Tensor, frames: int) -> torch.Tensor:
        """Image-to-video: the channels beside the noise at every step, from the first frame's
        `pixels` [1, 3, H, W] in [-1, 1]."""
        raise NotImplementedError(f"a {self.name} model takes no image")

    def reference_size(self, image: Any) -> tuple[int, int] | None:
        """Image-to-video: the (width, height) a first frame gives a video that names no size;
        None: the clip's default size."""
        return None

    def fit_reference(self, image: Any, width: int, height: int) -> Any:
        """Image-to-video: the first frame as the video's size takes it (here as it is: the VAE's
        processor resizes it to the size, as WanImageToVideoPipeline does)."""
        return image

    # 2. Latents and their schedule.

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.config.vae.get("block_out_channels", (0,) * 4)) - 1)

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (a planned reference model without a VAE config: the denoiser's)."""
        return int(self.config.vae.get("latent_channels", self.config.denoiser["in_channels"]))

    @property
    def inpainting_channels(self) -> int:
        """Input channels the denoiser takes beyond the latents: 5 (mask, masked image) for an
        inpainting UNet, else 0."""
        return int(self.config.denoiser["in_channels"]) - self.latent_channels

    @property
    def native_size(self) -> int:
        """The image side the denoiser was built for, in pixels."""
        return int(self.config.denoiser["sample_size"]) * self.vae_scale_factor

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this (8: what diffusers' pipelines require)."""
        return math.lcm(8, self.vae_scale_factor)

    @property
    def max_size(self) -> int | None:
        """The largest image side the denoiser can take, if it has one."""
        return None

    @property
    def clip(self) -> Clip | None:
        """A video family's clip (`server/requests/clip.py`: its default frames and size, its frames' rule and
        limit); None: the family makes images."""
        return None

    def held_dtype(self, part: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype `part` is loaded (and counted) in when the weights are in `dtype`."""
        return torch.float32 if part == "vae" and self.vae_float32 else dtype

    def latent_shape(self, width: int, height: int, frames: int | None = None) -> tuple[int, ...]:
        """One request's latents: [1, C, h, w] (a video family's: [1, C, latent frames, h, w])."""
        scale = self.vae_scale_factor
        return (1, self.latent_channels, height // scale, width // scale)

    def request_shape(self, request: GenerationRequest) -> tuple[int, ...]:
        """A request's latents (LTX-2's: its video's and its sound's together)."""
        return self.latent_shape(request.width, request.height, request.frames)

    def draw_noise(self, noise: torch.Tensor, generator: torch.Generator, shape: tuple) -> None:
        """Fill `noise` (of `request_shape`'s `shape`) as the family's pipeline draws it."""
        torch.randn(noise.shape, generator=generator, dtype=noise.dtype, out=noise)

    def set_timesteps(self, scheduler: Any, steps: int, device: torch.device, latent_shape: tuple) -> None:
        scheduler.set_timesteps(steps, device=device)

    def edit_begin(self, steps: int, strength: float) -> int:
        """Steps an edit at `strength` skips (diffusers' img2img `get_timesteps`: the steps it
        runs are floored)."""
        return max(steps - min(int(steps * strength), steps), 0)

    def init_noise_sigma(self, scheduler: Any) -> float:
        return float(scheduler.init_noise_sigma)

    def model_input(self, scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return scheduler.scale_model_input(latents, t)

    def noised(
        self, scheduler: Any, clean: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """Clean latents noised to timestep `t` (an edit's start, inpainting's known region)."""
        return scheduler.add_noise(clean, noise, t)

    # 3. Latents ↔ pixels.

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the VAE decodes them: undo the scaling (and shift) applied at training."""
        vae = self.config.vae
        return latents / vae["scaling_factor"] + (vae.get("shift_factor") or 0.0)

    def decoded_latents(self, latents: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
        """A request's latents (as many as were stepped together) as its VAE decodes them."""
        return self.unscale_latents(latents)

    def sound(
        self, parts: Sequence[nn.Module], latents: torch.Tensor, request: GenerationRequest
    ) -> torch.Tensor:
        """The waveforms [N, channels, samples] of finished latents, by `sound_parts`."""
        raise NotImplementedError(f"a {self.name} model makes no sound")

    def sample_rate(self) -> int:
        """The sound's samples a second."""
        raise NotImplementedError(f"a {self.name} model makes no sound")

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] as the VAE encodes them (a video VAE's: one-frame videos)."""
        return pixels

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE encoder's latents as the denoiser takes them: `unscale_latents` undone."""
        vae = self.config.vae
        return (latents - (vae.get("shift_factor") or 0.0)) * vae["scaling_factor"]

    def check(self, encoders: Sequence[nn.Module], denoiser: nn.Module) -> None:
        """Configs that disagree (raise ModelFolderError); nothing to check for SD."""

    def check_configs(self, where: str) -> None:
        """What the folder's configs ask that diffshard cannot serve as its pipeline does (raise
        ModelFolderError), read before any weight loads: a UNet that embeds the guidance scale
        (an LCM-distilled one) draws other pixels without that embedding."""
        if self.config.denoiser.get("time_cond_proj_dim") is not None:
            raise ModelFolderError(
                f"{where}/{self.denoiser}/config.json sets time_cond_proj_dim: a guidance-embedded "
                "(LCM-distilled) UNet, which diffshard does not condition on its guidance scale; serve "
                "its base model with the LCM LoRA (--lora) and LCMScheduler instead"
            )

    def pipeline_scheduler(self, scheduler: Any) -> Any:
        """The folder's scheduler as the family's pipeline sets it up: as saved, for most."""
        return scheduler

    def default_scheduler(self) -> Any | None:
        """The scheduler its pipeline makes where the folder ships none (a modular pipeline's
        blocks make theirs from their own config); None: the folder must ship one."""
        return None

    @property
    def alpha(self) -> bool:
        """Whether its VAE decodes an alpha channel beside the colours ([4, H, W]: Qwen-Image
        2.1's RGBA images); the others' images are opaque."""
        return False

    @property
    def flow_map(self) -> bool:
        """Whether its denoiser also takes the timestep each step jumps to (`TARGET_TIMESTEP`:
        a step-distilled flow map's)."""
        return False

    def attach(self, vae: nn.Module) -> None:
        """Read what the latents' scaling keeps in the VAE's weights (FLUX.2's batch-norm
        statistics), once loaded; the others' is in its config."""

    # ControlNets (`conditioning/controlnets.py`): the UNet families' `ControlNetModel` here; others override.

    def control_refusal(self, config: dict[str, Any]) -> str | None:
        """Why a ControlNet of a class `controlnets` names cannot run here (None: it can)."""
        return None

    def control_image(
        self, net: nn.Module, image: Any, width: int, height: int, vae: nn.Module, generator: torch.Generator
    ) -> torch.Tensor:
        """A control image [1, ...] as the family's ControlNet pipeline gives `net`: here RGB in
        [0, 1] at the image's size (StableDiffusion(XL)ControlNetPipeline's processor)."""
        processor = VaeImageProcessor(do_convert_rgb=True, do_normalize=False)
        return processor.preprocess(image, height=height, width=width).to(torch.float32)

    def control_residuals(self, net: nn.Module, inputs: Any, image: torch.Tensor) -> dict[str, Any]:
        """`net`'s residuals for `inputs`' rows (DenoiserInputs) and their control `image`, unscaled,
        by the denoiser's keyword."""
        down, mid = net(
            inputs.sample,
            inputs.timestep,
            encoder_hidden_states=inputs.context,
            controlnet_cond=image,
            added_cond_kwargs=inputs.conditioning.get("added_cond_kwargs"),
            return_dict=False,
        )
        return {"down_block_additional_residuals": tuple(down), "mid_block_additional_residual": mid}


def inner_width(config: dict[str, Any]) -> int:
    """A DiT's (or its ControlNet's) block width: the last dim of a ControlNet's residuals."""
    return config["num_attention_heads"] * config["attention_head_dim"]


def other_width(net: dict[str, Any], denoiser: dict[str, Any]) -> str | None:
    """Why a DiT's ControlNet cannot run beside `denoiser`: its blocks' width differs (None: same)."""
    width, ours = inner_width(net), inner_width(denoiser)
    if width != ours:
        return f"it was made for another model: its blocks are {width} wide, the transformer's {ours}"
    return None


def tokenize(tokenizer: Any, prompts: list[str]) -> Any:
    """Every prompt padded to the tokenizer's full length: CLIP's causal attention keeps the
    padding from reaching the tokens before it, so prompts batch without changing each other."""
    return tokenizer(
        prompts,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    )


def penultimate_states(
    encoder: nn.Module, tokenizer: Any, prompts: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the penultimate hidden states [N, T, D], the encoder's first output) as SDXL and SD3 take them;
    the first output is the pooled projection of a CLIPTextModelWithProjection."""
    out = encoder(tokenize(tokenizer, prompts).input_ids.to(_device(encoder)), output_hidden_states=True)
    return out.hidden_states[-2], out[0]


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def padded_text(states: torch.Tensor, mask: torch.Tensor, drop: int, length: int) -> TextEmbeddings:
    """Each prompt's hidden states where `mask` is set, less the first `drop` (the template's),
    at most `length`, zero-padded to `length` with a mask of the tokens kept (the pipelines'
    `_extract_masked_hidden`, then `prompt_embeds[:, :max_sequence_length]`)."""
    context = states.new_zeros(states.shape[0], length, states.shape[-1])
    kept = torch.zeros(states.shape[0], length, device=states.device)
    for row, (hidden, used) in enumerate(zip(states, mask.bool(), strict=True)):
        own = hidden[used][drop:][:length]
        context[row, : own.shape[0]] = own
        kept[row, : own.shape[0]] = 1
    return TextEmbeddings(context, rows={TEXT_MASK: kept})


# The guider's settings rows' guidance follows; others (rescale, the original formulation, a window
# of steps) change the prediction in ways a negative row does not.
PLAIN_GUIDER = {"guidance_rescale": 0.0, "use_original_formulation": False, "start": 0.0, "stop": 1.0}


def plain_guider(guider: dict[str, Any]) -> str | None:
    """Why a folder's guider (`guider/guider_config.json`) is not served as classifier-free
    guidance by a negative row, naming the file and what to change; None where it is."""
    if guider and guider.get("_class_name") != "ClassifierFreeGuidance":
        return (
            f"guider is a {guider.get('_class_name')}; diffshard guides as ClassifierFreeGuidance does "
            "(a negative row)"
        )
    changed = sorted(k for k, v in PLAIN_GUIDER.items() if guider.get(k, v) != v)
    if changed or guider.get("enabled", True) is False:
        return (
            f"guider/guider_config.json sets {', '.join(changed) or 'enabled: false'}; diffshard guides "
            "with the scale alone (set guidance_scale 1.0 to turn guidance off)"
        )
    return None


def edit_size(size: tuple[int, int], multiple: int, area: int | None) -> tuple[int, int]:
    """An edit image's (width, height) as a pipeline sizes its output by it: scaled down to `area`
    where larger (FLUX.2's Flux2ImageProcessor._resize_to_target_area), then floored to `multiple`."""
    width, height = size
    if area is not None and width * height > area:
        scale = math.sqrt(area / (width * height))
        width, height = int(width * scale), int(height * scale)
    return width - width % multiple, height - height % multiple
