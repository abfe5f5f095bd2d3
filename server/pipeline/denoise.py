"""Per-request generation state and the batched, sharded denoising step.

A request becomes a `RequestState`: its prompt embeddings (negative rows first, as diffusers
stacks them), latents drawn exactly as diffusers draws them, its own scheduler instance and
step index, its generator and guidance scale, and a pool scope holding everything it rented.
`Pipeline.step` advances any number of compatible states by one denoising step in a single
UNet call through the ModelShard: each row carries its own timestep, so requests at different
steps, with different schedulers and guidance scales, share the forward.

    pipeline = Pipeline.load(MODEL_DIR, devices="cpu")
    images = pipeline.generate([GenerationRequest("a red circle", seed=1)])
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.demo import MODEL_DIR
from server.engine import ModelShard, plan_shards
from server.engine.devices import normalize_device
from server.engine.pool import ActivationPool, PoolScope
from server.pipeline.loader import Components, load_components
from server.pipeline.schedulers import SCHEDULER_NAMES, make_scheduler
from server.pipeline.text import PromptEncoder

LATENT_DTYPE = torch.float32  # scheduler arithmetic stays in float32 whatever the model's dtype


class RequestError(ValueError):
    """A request the pipeline cannot run; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class GenerationRequest:
    """One image. Unset fields take the pipeline's defaults (`Pipeline.defaults`)."""

    prompt: str
    negative_prompt: str | None = None
    seed: int = 0
    steps: int | None = None
    guidance_scale: float | None = None
    scheduler: str | None = None
    width: int | None = None
    height: int | None = None


@dataclass(frozen=True)
class Defaults:
    steps: int
    guidance_scale: float
    scheduler: str
    size: int  # native image side in pixels


@dataclass
class RequestState:
    """Everything one request carries between steps; `close()` returns what it rented."""

    request: GenerationRequest  # resolved: every field set
    scheduler: Any
    generator: torch.Generator
    latents: torch.Tensor  # [1, C, h, w], LATENT_DTYPE, updated in place every step
    context: torch.Tensor  # [rows, tokens, dim]: negative row first when guided
    added: dict[str, torch.Tensor]  # SDXL's added_cond_kwargs rows; empty for SD
    scope: PoolScope
    index: int = 0  # steps taken
    image: torch.Tensor | None = None  # [H, W, 3] float in [0, 1] once decoded (rented)
    closed: bool = False  # its buffers went back to the pool: it must not be stepped or decoded
    _step_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.context.shape[0]

    @property
    def steps(self) -> int:
        return len(self.scheduler.timesteps)

    @property
    def done(self) -> bool:
        return self.index >= self.steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.scheduler.timesteps[self.index]

    @property
    def group(self) -> tuple[Any, ...]:
        """States with equal groups can share one UNet call and one VAE decode."""
        return (*self.latents.shape[1:], *self.context.shape[1:])

    def close(self) -> None:
        """End the request (finished, failed or cancelled); safe to call more than once."""
        self.closed = True
        self.scope.close()


class Pipeline:
    """Text encoders, VAE and a sharded UNet, run request by request or many at once."""

    def __init__(
        self,
        components: Components,
        shard: ModelShard,
        pool: ActivationPool | None = None,
        *,
        encoder_device: str | None = None,
        defaults: Defaults | None = None,
    ) -> None:
        self.components = components
        self.kind = components.kind
        self.shard = shard
        self.pool = pool or ActivationPool()
        self.device = shard.device  # latents and the UNet's inputs and outputs live here
        self.encoder_device = (
            torch.device(normalize_device(encoder_device)) if encoder_device else self.device
        )
        unet, vae = components.unet, components.vae
        self.unet_dtype = next(unet.parameters()).dtype
        self.latent_channels = unet.config.in_channels
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.prompts = PromptEncoder(
            components.kind,
            components.tokenizers,
            tuple(encoder.to(self.encoder_device) for encoder in components.text_encoders),
        )
        if vae.dtype == torch.float16 and vae.config.get("force_upcast", False):
            vae.to(torch.float32)  # such VAEs overflow in float16: diffusers upcasts them too
        self.vae = vae.to(self.encoder_device)
        self.zero_negative = components.kind == "sdxl" and components.index.get(
            "force_zeros_for_empty_prompt", True
        )
        self.defaults = defaults or _defaults(components, unet.config.sample_size * self.vae_scale_factor)
        if components.kind == "sdxl":
            self._check_added_embedding()

    @classmethod
    def load(
        cls,
        folder: str | Path = MODEL_DIR,
        *,
        devices: str | Sequence[str] = "auto",
        strategy: str = "memory",
        dtype: torch.dtype = torch.float32,
        max_memory: str | Mapping[str, str | int] | None = None,
        device_map: Mapping[str, str] | None = None,
        encoder_device: str | None = None,
        pool: ActivationPool | None = None,
    ) -> Pipeline:
        """Load a folder, plan the UNet's split across `devices` and place it."""
        components = load_components(folder, dtype)
        plan = plan_shards(
            components.unet,
            devices,
            strategy,
            max_memory=max_memory,
            device_map=device_map,
            dtype=dtype,
            latent_size=components.unet.config.sample_size,
        )
        return cls(components, ModelShard(components.unet, plan), pool, encoder_device=encoder_device)

    # One request's life: start → step … → decode → close.

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with every unset field filled in from the defaults, checked."""
        d = self.defaults
        request = replace(
            request,
            steps=d.steps if request.steps is None else request.steps,
            guidance_scale=d.guidance_scale if request.guidance_scale is None else request.guidance_scale,
            scheduler=request.scheduler or d.scheduler,
            width=d.size if request.width is None else request.width,
            height=d.size if request.height is None else request.height,
        )
        _check(request, math.lcm(8, self.vae_scale_factor))  # 8: what diffusers' pipelines require
        return request

    @torch.inference_mode()
    def start(self, requests: Sequence[GenerationRequest]) -> list[RequestState]:
        """States for `requests`, every prompt encoded in one batched call."""
        requests = [self.resolve(r) for r in requests]
        texts: list[str] = []
        for r in requests:
            if r.guidance_scale > 1 and not (self.zero_negative and r.negative_prompt is None):
                texts.append(r.negative_prompt or "")
            texts.append(r.prompt)
        embeddings = self.prompts.encode(texts)
        states: list[RequestState] = []
        try:
            row = 0
            for r in requests:
                guided, zeros = r.guidance_scale > 1, self.zero_negative and r.negative_prompt is None
                take = 1 + (guided and not zeros)
                context = embeddings.context[row : row + take]
                pooled = None if embeddings.pooled is None else embeddings.pooled[row : row + take]
                if guided and zeros:  # SDXL: an unset negative prompt conditions on zeros
                    context = torch.cat([torch.zeros_like(context), context])
                    pooled = torch.cat([torch.zeros_like(pooled), pooled])
                row += take
                states.append(self._new_state(r, context, pooled))
        except BaseException:
            for state in states:
                state.close()
            raise
        return states

    def _new_state(
        self, request: GenerationRequest, context: torch.Tensor, pooled: torch.Tensor | None
    ) -> RequestState:
        scope = PoolScope(self.pool)
        try:
            scheduler = make_scheduler(self.components.scheduler, request.scheduler)
            scheduler.set_timesteps(request.steps, device=self.device)
            if hasattr(scheduler, "set_begin_index"):
                scheduler.set_begin_index(0)
            shape = (
                1,
                self.latent_channels,
                request.height // self.vae_scale_factor,
                request.width // self.vae_scale_factor,
            )
            # Noise as diffusers' randn_tensor draws it: on the CPU generator, then moved.
            generator = torch.Generator("cpu").manual_seed(request.seed)
            noise = scope.rent(shape, LATENT_DTYPE, "cpu", pinned=self.device.type == "cuda")
            torch.randn(shape, generator=generator, dtype=LATENT_DTYPE, out=noise)
            latents = scope.rent(shape, LATENT_DTYPE, self.device)
            latents.copy_(noise)
            latents.mul_(scheduler.init_noise_sigma)
            scope.give_back(noise)
            kept = scope.rent(context.shape, self.unet_dtype, self.device)
            kept.copy_(context)
            added = {}
            if pooled is not None:
                added["text_embeds"] = scope.rent(pooled.shape, self.unet_dtype, self.device)
                added["text_embeds"].copy_(pooled)
                size = (request.height, request.width)
                added["time_ids"] = scope.rent((context.shape[0], 6), self.unet_dtype, self.device)
                added["time_ids"].copy_(torch.tensor([*size, 0, 0, *size], dtype=self.unet_dtype))
            return RequestState(
                request,
                scheduler,
                generator,
                latents,
                kept,
                added,
                scope,
                _step_kwargs=_step_kwargs(type(scheduler), generator),
            )
        except BaseException:
            scope.close()
            raise

    @torch.inference_mode()
    def step(self, states: Sequence[RequestState]) -> None:
        """Advance every state by one step in a single batched UNet call."""
        if not states:
            return
        if any(s.done or s.closed for s in states):
            raise ValueError("a finished or closed request cannot take another step")
        _check_group(states)
        first, rows = states[0], sum(s.rows for s in states)
        with self.pool.scope() as batch:
            sample = batch.rent((rows, *first.latents.shape[1:]), self.unet_dtype, self.device)
            timesteps = batch.rent((rows,), torch.float32, self.device)
            context = batch.rent((rows, *first.context.shape[1:]), self.unet_dtype, self.device)
            added = {
                name: batch.rent((rows, *rows_of.shape[1:]), rows_of.dtype, self.device)
                for name, rows_of in first.added.items()
            }
            for state, span in zip(states, _spans(states), strict=True):
                sample[span] = state.scheduler.scale_model_input(state.latents, state.timestep)
                timesteps[span] = state.timestep
                context[span] = state.context
                for name, rows_of in added.items():
                    rows_of[span] = state.added[name]
            out = self.shard(sample, timesteps, context, added_cond_kwargs=added or None)
            for state, span in zip(states, _spans(states), strict=True):
                prediction = out[span].to(LATENT_DTYPE)
                if state.rows == 2:  # classifier-free guidance: negative row, then prompt row
                    negative, positive = prediction.chunk(2)
                    prediction = negative + state.request.guidance_scale * (positive - negative)
                latents = state.scheduler.step(
                    prediction, state.timestep, state.latents, return_dict=False, **state._step_kwargs
                )[0]
                state.latents.copy_(latents)
                state.index += 1

    @torch.inference_mode()
    def decode(self, states: Sequence[RequestState]) -> list[torch.Tensor]:
        """Decode finished states in one VAE call; each image lands in a buffer its scope rents."""
        if not states:
            return []
        if any(s.closed for s in states):
            raise ValueError("a closed request cannot be decoded")
        _check_group(states)
        vae = self.vae
        latents = torch.cat([s.latents for s in states]).to(self.encoder_device, vae.dtype)
        mean, std = vae.config.get("latents_mean"), vae.config.get("latents_std")
        if mean is not None and std is not None:  # SDXL-family VAEs with normalised latents
            shape = (1, -1, 1, 1)
            mean_t = torch.tensor(mean, dtype=latents.dtype, device=latents.device).view(shape)
            std_t = torch.tensor(std, dtype=latents.dtype, device=latents.device).view(shape)
            latents = latents * std_t / vae.config.scaling_factor + mean_t
        else:
            latents = latents / vae.config.scaling_factor
        pixels = (vae.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)
        pinned = self.encoder_device.type == "cuda"
        for state, image in zip(states, pixels, strict=True):
            image = image.permute(1, 2, 0)  # [H, W, 3], as diffusers' output_type="np"
            state.image = state.scope.rent(image.shape, torch.float32, "cpu", pinned=pinned)
            state.image.copy_(image, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize(self.encoder_device)
        return [s.image for s in states]

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_step: Callable[[Sequence[RequestState]], None] | None = None,
    ) -> list[np.ndarray]:
        """Run `requests` together to the end: every step one batched call per size group.

        Returns each image as a float32 [H, W, 3] array in [0, 1] (diffusers' output_type="np").
        `on_step` sees the states after every step; an exception from it (or anywhere) ends
        every request and returns everything they rented.
        """
        states = self.start(requests)
        try:
            while active := [s for s in states if not s.done]:
                for group in group_states(active):
                    self.step(group)
                if on_step is not None:
                    on_step(states)
            for group in group_states(states):
                self.decode(group)
            return [s.image.numpy().copy() for s in states]  # copied out before the scopes close
        finally:
            for state in states:
                state.close()

    def _check_added_embedding(self) -> None:
        """SDXL's added embedding must take the pooled text plus 6 size ids, as diffusers checks."""
        unet = self.components.unet
        pooled = self.components.text_encoders[-1].config.projection_dim
        given = unet.config.addition_time_embed_dim * 6 + pooled
        expected = unet.add_embedding.linear_1.in_features
        if given != expected:
            raise ValueError(
                f"the UNet's added embedding takes {expected} features but the text encoder's pooled "
                f"projection ({pooled}) and 6 time ids make {given}: the folder's configs disagree"
            )


def _check(request: GenerationRequest, scale: int) -> None:
    if not request.prompt:
        raise RequestError("prompt", "must not be empty")
    if not 1 <= request.steps <= 1000:
        raise RequestError("steps", f"must be between 1 and 1000, got {request.steps}")
    if not (math.isfinite(request.guidance_scale) and request.guidance_scale >= 0):
        raise RequestError("guidance_scale", f"must be a finite number ≥ 0, got {request.guidance_scale}")
    if request.scheduler not in SCHEDULER_NAMES:
        names = ", ".join(SCHEDULER_NAMES)
        raise RequestError("scheduler", f"must be one of {names}, got {request.scheduler!r}")
    for name in ("width", "height"):
        value = getattr(request, name)
        if value <= 0 or value % scale:
            raise RequestError(name, f"must be a positive multiple of {scale}, got {value}")
    if not 0 <= request.seed < 2**63:
        raise RequestError("seed", f"must be between 0 and 2**63-1, got {request.seed}")


def _defaults(components: Components, size: int) -> Defaults:
    """The folder's recommended settings (recommended.json, as the built-in model has), else diffusers'."""
    recommended = Path(components.folder) / "recommended.json"
    if recommended.is_file():
        settings = json.loads(recommended.read_text()).get("recommended", {})
        return Defaults(
            steps=int(settings.get("num_inference_steps", 50)),
            guidance_scale=float(settings.get("guidance_scale", 7.5)),
            scheduler="default",
            size=int(settings.get("size", size)),
        )
    guidance = 5.0 if components.kind == "sdxl" else 7.5
    return Defaults(steps=50, guidance_scale=guidance, scheduler="default", size=size)


@cache
def _accepts(scheduler_class: type, argument: str) -> bool:
    return argument in inspect.signature(scheduler_class.step).parameters


def _step_kwargs(scheduler_class: type, generator: torch.Generator) -> dict[str, Any]:
    """What diffusers' prepare_extra_step_kwargs passes: eta=0 (DDIM) and the request's generator."""
    kwargs: dict[str, Any] = {}
    if _accepts(scheduler_class, "eta"):
        kwargs["eta"] = 0.0
    if _accepts(scheduler_class, "generator"):
        kwargs["generator"] = generator
    return kwargs


def _check_group(states: Sequence[RequestState]) -> None:
    if len({s.group for s in states}) > 1:
        raise ValueError("requests of different sizes cannot share a UNet or VAE call; group them by `group`")


def _spans(states: Sequence[RequestState]) -> Iterable[slice]:
    start = 0
    for state in states:
        yield slice(start, start + state.rows)
        start += state.rows


def group_states(states: Sequence[RequestState]) -> list[list[RequestState]]:
    """States in groups that can share a UNet call and a VAE decode, in first-seen order."""
    groups: dict[tuple[Any, ...], list[RequestState]] = {}
    for state in states:
        groups.setdefault(state.group, []).append(state)
    return list(groups.values())
