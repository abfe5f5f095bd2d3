"""The generation pipeline: a model family's encoders and VAE around a sharded denoiser, run
request by request or many requests at once.

A request becomes a `RequestState`: its conditioning rows (negative first, as diffusers stacks
them), latents drawn exactly as diffusers draws them, its own scheduler instance and step index,
its generator and guidance scale, and a pool scope holding everything it rented. `step` advances
any number of compatible states by one denoising step in a single call through the ModelShard:
each row carries its own timestep, so requests at different steps, with different schedulers and
guidance scales, share the forward.

    pipeline = Pipeline.load(MODEL_DIR, devices="cpu")
    images = pipeline.generate([GenerationRequest("a red circle", seed=1)])
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.demo import MODEL_DIR
from server.engine import (
    ActivationPool,
    CallPlan,
    CallResult,
    ModelShard,
    ParallelPlan,
    ShardPlan,
    plan_shards,
)
from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.denoisers.wan import IMAGE
from server.engine.hardware.devices import normalize_device, wait_for_queued
from server.engine.quantize import compute_dtype
from server.engine.runtime.call import AdapterRows, RowsSlot
from server.engine.runtime.compile import run_decoder
from server.engine.runtime.pool import PoolScope
from server.errors import InvalidRequest
from server.pipeline.conditioning.adapters import Adapter, Adapters, Target
from server.pipeline.conditioning.controlnets import ControlNets
from server.pipeline.conditioning.edits import first_latents, keep_unmasked
from server.pipeline.conditioning.live_changes import CHANGES, unknown_adapter
from server.pipeline.loading.deployment import Deployment, ExpertSteps, GroupCalls, Lane, Spare, matching
from server.pipeline.loading.folder import Components, load_components, read_family
from server.pipeline.loading.parts import place_parts
from server.pipeline.loading.quantized_parts import (
    QuantizeSetting,
    describe,
    held_bytes,
    load_quantizations,
    placed_in_groups,
    placing,
)
from server.pipeline.resolve import read_defaults, resolve, with_defaults
from server.pipeline.steps.advance import advance, call_plan, expert_calls
from server.pipeline.steps.schedulers import make_scheduler, step_kwargs
from server.pipeline.steps.state import RequestState, check_group, group_states, per_call, stack_inputs
from server.requests.generation import Defaults, GenerationRequest

LATENT_DTYPE = torch.float32  # scheduler arithmetic stays in float32 whatever the model's dtype


class Pipeline:
    """A family's text encoders and VAE, and its denoiser split by a ModelShard."""

    def __init__(
        self,
        components: Components,
        deployment: Deployment | ModelShard,
        pool: ActivationPool | None = None,
        *,
        encoder_device: str | None = None,
        defaults: Defaults | None = None,
        lane: Lane | None = None,
        vae_tiling: bool = False,
        more_experts: Sequence[Deployment] = (),
    ) -> None:
        if isinstance(deployment, ModelShard):
            deployment = Deployment((deployment,))
        self.components = components
        self.family = components.family
        self.deployment = deployment
        self.lane = lane or deployment.first_lane()  # the lane this pipeline (view) steps
        self.shard = self.lane.shard
        self.experts = (deployment, *more_experts)  # every expert's, `family.experts`' order
        self.expert_lanes = (self.lane, *(d.first_lane() for d in more_experts))  # this view's
        self.expert_steps = ExpertSteps(self.family.experts)  # shared by the lanes' views
        self.pool = pool or ActivationPool()
        self.device = self.shard.device  # latents and the denoiser's inputs and outputs live here
        self.encoder_device = (
            torch.device(normalize_device(encoder_device)) if encoder_device else self.device
        )
        self.denoiser_dtype = compute_dtype(components.denoiser)
        spread = [] if encoder_device else deployment.encoder_spread()  # see loading/parts.py
        self.encoders, self.vae = place_parts(components, self.encoder_device, spread, vae_tiling)
        self.sound_parts = tuple(part.to(self.encoder_device) for part in components.sound_parts)
        self.defaults = defaults or read_defaults(components.folder, self.family)
        self.family.check(self.encoders, components.denoiser)
        self.family.attach(self.vae)
        self.replicas = deployment.replicas
        self.lanes_per_replica = deployment.lanes_per_replica
        self.lane_threads = deployment.threads  # intra-op threads each lane's thread runs
        self.splits_lone = deployment.splits_lone
        self._encoding = threading.Lock()  # lanes share the tokenizers, which are not thread-safe
        self.encoder_slots = [RowsSlot() for _ in self.encoders]  # the encoding's adapter rows
        self.adapters = Adapters({})  # LoRA adapters served (shared by the lanes' views)
        self.controlnets = ControlNets(self.family, self.device, self.denoiser_dtype, self.shard.model.config)
        self.decoder: Callable[[torch.Tensor], torch.Tensor] = partial(run_decoder, self.vae)  # or compiled
        self.quantization = "off"  # what is quantized (quantized_parts.describe)

    @classmethod
    def load(
        cls,
        folder: str | Path = MODEL_DIR,
        *,
        plan: ShardPlan | ParallelPlan | None = None,
        devices: str | Sequence[str] = "auto",
        strategy: str = "memory",
        dtype: torch.dtype = torch.float32,
        max_memory: str | Mapping[str, str | int] | None = None,
        device_map: Mapping[str, str] | None = None,
        encoder_device: str | None = None,
        pool: ActivationPool | None = None,
        quantize: str | QuantizeSetting = "off",
        denoiser_file: Path | None = None,
        vae_tiling: bool = False,
        components: Components | None = None,
    ) -> Pipeline:
        """Load a folder and place its denoiser by `plan`, or by a plan made here from
        `devices`, `strategy`, `max_memory` and `device_map` (see `server.engine.plan_shards`).
        A ParallelPlan places every replica; `lanes()` then gives a view per lane. `quantize`:
        `--quantize`'s setting (`server.pipeline.loading.quantized_parts`); `denoiser_file`: a GGUF file
        holding the denoiser's weights; `vae_tiling`: decode and encode in diffusers' tiles;
        `components`: the parts built already (the GPU check's, on the device), not read from `folder`."""
        family = read_family(folder)
        quantizations = load_quantizations(quantize, family, Path(folder), dtype, denoiser_file)
        if isinstance(plan, ParallelPlan) and plan.tensor > 1:
            quantizations = placed_in_groups(quantizations, family)
        components = components or load_components(folder, dtype, quantizations, denoiser_file)
        if plan is None:
            held = held_bytes(components.denoiser, dtype, quantizations.get(family.denoiser), denoiser_file)
            plan = plan_shards(
                components.denoiser,
                devices,
                strategy,
                max_memory=max_memory,
                device_map=device_map,
                dtype=dtype,
                block_bytes=held,
                experts=len(family.experts),
            )
        # every expert by the one plan, beside the first's; or each apart (replica k: expert k's)
        apart = isinstance(plan, ParallelPlan) and plan.experts_apart
        places = plan.replicas if apart else (plan,) * len(components.experts)
        deployment, *more = (
            Deployment.of(model, place, placing(quantizations, components, k))
            for k, (model, place) in enumerate(zip(components.experts, places, strict=True))
        )
        pipeline = cls(
            components,
            deployment,
            pool,
            encoder_device=encoder_device,
            vae_tiling=vae_tiling,
            more_experts=more,
        )
        pipeline.quantization = describe(quantize, denoiser_file)
        return pipeline

    def lanes(self, spare: Callable[[int], Spare] | None = None, splits: bool = True) -> list[Pipeline]:
        """A view of this pipeline per lane of its deployment (`Deployment.lanes`): the
        encoders, VAE, pool and defaults are shared; each lane steps its own requests through
        its replica's shard, where the stage gates interleave the lanes."""
        views, first, groups = [], self.deployment, GroupCalls()
        more = [d.lanes(spare and matching(spare, first, d), splits, groups) for d in self.experts[1:]]
        for i, lane in enumerate(first.lanes(spare, splits, groups)):
            view = copy.copy(self)
            view.lane, view.shard, view.device = lane, lane.shard, lane.shard.device
            view.expert_lanes = (lane, *(lanes[i] for lanes in more))
            views.append(view)
        return views

    def add_adapter(self, adapter: Adapter) -> None:
        """Serve `adapter`: attached to every replica's denoiser and to the encoders it targets."""
        encoders = zip(self.family.text_encoders, self.encoders, self.encoder_slots, strict=False)
        self.adapters.targets = {  # absent encoders are last
            **{
                name: list({id(s.model): Target(s.model, s.slot_of) for s in d.replicas}.values())
                for name, d in zip(self.family.experts, self.experts, strict=True)
            },
            **{name: [Target(e, lambda _layer, slot=slot: slot)] for name, e, slot in encoders},
        }
        self.adapters.add(adapter)

    def synchronize(self) -> None:
        """Wait for this lane's work on each GPU its calls use (every expert's, its ranks', the
        replicas it lends rows to): up to where its calls left each stage; on the latents' and
        encoders' GPU, up to now (steps and encodes follow there). Never a device-wide sync."""
        here = {str(self.device), str(self.encoder_device)}
        fences = {d: e for lane in self.expert_lanes for d, e in lane.fences.items() if d not in here}
        wait_for_queued(here.union(*(lane.devices() for lane in self.expert_lanes)), fences)

    # One request's life: resolve → start → step … → decode → close.

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with every unset field filled in from the defaults, checked against the model."""
        for name, _ in request.lora:
            if name not in self.adapters.loaded:
                raise InvalidRequest("lora", unknown_adapter(name, self.adapters.loaded))
        self.controlnets.check(request.control)
        return resolve(request, self.defaults, self.family)

    def with_defaults(self, request: GenerationRequest) -> GenerationRequest:
        return with_defaults(request, self.defaults)

    def rows(self, request: GenerationRequest) -> int:
        """Denoiser rows the (resolved) request takes at every step."""
        return self.family.rows(request)

    @torch.inference_mode()
    def start(self, requests: Sequence[GenerationRequest]) -> list[RequestState]:
        """States for resolved `requests`, every prompt encoded in one batched call."""
        if not all(r.resolved for r in requests):
            raise ValueError("start() takes resolved requests: pass them through resolve() first")
        # 1. Encode every row's text at once: per request, the negative row (if any) first.
        zero_unset = self.family.zero_unset_negative
        texts, asking, shown = [], [], []  # each text, its request's adapters and its edit's images
        for r in requests:
            negative = self.family.negative_row(r) and not (zero_unset and r.negative_prompt is None)
            for text in [r.negative_prompt or ""] * negative + [r.prompt]:
                texts.append(text)
                asking.append(r.lora)
                shown.append(self.family.images_seen(r))
        with self._encoding, CHANGES.reading():  # reading: held, a compile's warm-up never pauses here
            rows = AdapterRows(tuple(asking)) if any(asking) else None
            for slot in self.encoder_slots:
                slot.rows = rows
            try:  # a family that reads an edit's images with its prompt (Qwen-Image-Edit) is given them
                seen = (shown,) if self.family.sees_images else ()
                embeddings = self.family.encode(self.encoders, self.components.tokenizers, texts, *seen)
            finally:
                for slot in self.encoder_slots:
                    slot.rows = None
        # 2. Every first frame's image tokens (image-to-video), in one call; 3. each request's rows.
        images = self._image_tokens(requests)
        states: list[RequestState] = []
        try:
            row = 0
            for i, r in enumerate(requests):
                guided, zeros = self.family.negative_row(r), zero_unset and r.negative_prompt is None
                take = 1 + (guided and not zeros)
                own = self.family.more_rows(embeddings.take(row, take, zero_negative=guided and zeros), r)
                row += take
                references, layout = self.family.references(self.vae, r, own.context.shape[0])
                extras = {**self.family.extras(own.pooled, r), **own.rows, **references}
                if i in images:  # the same on the negative row, as WanImageToVideoPipeline repeats it
                    extras[IMAGE] = images[i].expand(own.context.shape[0], -1, -1)
                states.append(self._new_state(r, own.context, extras, layout))
        except BaseException:
            for state in states:
                state.close()
            raise
        return states

    def _image_tokens(self, requests: Sequence[GenerationRequest]) -> dict[int, torch.Tensor]:
        """Each first frame's image tokens [1, T, D] by its request's index (image-to-video)."""
        parts = self.components  # Wan 2.2's image-to-video has no image encoder: no image tokens
        at = [i for i, r in enumerate(requests) if r.reference is not None and parts.image_encoder]
        frames = [requests[i].reference for i in at]
        tokens = self.family.encode_images(parts.image_encoder, parts.image_processor, frames) if at else None
        return {i: tokens[k : k + 1] for k, i in enumerate(at)}

    def _new_state(
        self, request: GenerationRequest, context: torch.Tensor, extras: dict[str, Any], layout: tuple
    ) -> RequestState:
        scope = PoolScope(self.pool)
        try:
            family = self.family
            shape = family.request_shape(request)
            scheduler = make_scheduler(self.components.scheduler, request.scheduler)
            # the schedule on the host, as a GPU pipeline's sigmas are: schedulers index their
            # tables by the timestep and compare it, each a read that waits for the GPU
            family.set_timesteps(scheduler, request.steps, torch.device("cpu"), shape)
            edit, begin = None if family.edits_by_reference else request.edit, 0
            if edit is not None:
                begin = family.edit_begin(request.steps, edit.strength) * scheduler.order
            if hasattr(scheduler, "set_begin_index"):
                scheduler.set_begin_index(begin)
            generator = torch.Generator("cpu").manual_seed(request.seed)  # as diffusers'; controls draw first
            controls = self.controlnets.rows(request, context.shape[0], self.vae, generator)
            start = first_latents(
                edit,
                family=family,
                vae=self.vae,
                scheduler=scheduler,
                first_t=scheduler.timesteps[begin],
                generator=generator,
                scope=scope,
                width=request.width,
                height=request.height,
                device=self.device,
                dtype=self.denoiser_dtype,
                frames=request.frames,
                reference=request.reference,
                shape=shape,
            )
            kept = {}
            for name, rows in {"context": context, **extras}.items():
                dtype = torch.float32 if name in family.precise_rows else self.denoiser_dtype
                kept[name] = scope.rent(rows.shape, dtype, self.device)
                kept[name].copy_(rows)
            return RequestState(
                request,
                scheduler,
                generator,
                start.latents,
                kept.pop("context"),
                kept,
                scope,
                begin=begin,
                inpainting=start.inpainting,
                conditioning=start.conditioning,
                first_frame=start.first_frame,
                step_kwargs=step_kwargs(type(scheduler), generator),
                layout=layout,
                controls=controls,
            )
        except BaseException:
            scope.close()
            raise

    @torch.inference_mode()
    def step(self, states: Sequence[RequestState]) -> None:
        """Advance every state by one step in a single batched denoiser call (one per expert due)."""
        if not states:
            return
        if any(s.done or s.closed for s in states):
            raise ValueError("a finished or closed request cannot take another step")
        check_group(states)
        with self.pool.scope() as batch:
            # 1.-2. Every state's rows stacked and run in one call through the shard (and any idle
            # replicas, a share of the rows each), as its plan says: a call per expert due.
            by_expert, outs = expert_calls(
                states, self.expert_lanes, self.family, partial(self.stacked, batch=batch)
            )
            self.expert_steps.count(by_expert)
            # 3. Per state: guidance, then its own scheduler's step (and, where a partial image is
            # due, the predicted clean latents).
            previews: list[tuple[RequestState, int, torch.Tensor]] = []
            for state in states:
                due = advance(state, outs[id(state)].to(LATENT_DTYPE), self.family)
                if due is not None:
                    previews.append((state, *due))
            # 4. The partial images due at this step, batched per size as `decode` batches.
            for group in group_states([s for s, _, _ in previews]):
                due = [(s, k, x0) for s, k, x0 in previews if any(s is g for g in group)]
                for start in range(0, len(due), count := per_call(group)):
                    chunk = due[start : start + count]
                    pixels = self._pixels(torch.cat([x0 for _, _, x0 in chunk]), chunk[0][0].request)
                    for (state, index, _), image in zip(chunk, pixels, strict=True):
                        state.preview = (index, state.frames_last(image).float().cpu())

    def stacked(self, states: Sequence[RequestState], batch: PoolScope) -> DenoiserInputs:
        """The denoiser's inputs for every state's rows (in buffers `batch` rents), controls' too."""
        inputs = stack_inputs(states, batch, self.family, self.denoiser_dtype, self.device)
        inputs.conditioning.update(self.controlnets.residuals(states, inputs))
        return inputs

    call_plan = staticmethod(call_plan)

    def forward(self, inputs: DenoiserInputs, plan: CallPlan) -> CallResult:
        """The (first) denoiser on `inputs` as `plan` says, through this lane (`Lane.forward`)."""
        return self.lane.forward(inputs, plan)

    @torch.inference_mode()
    def decode(self, states: Sequence[RequestState]) -> list[torch.Tensor]:
        """Decode finished states in VAE calls of at most DECODE_PIXELS (`tiling.images_per_call`:
        the VAE's activations grow with pixels, and a batch of large images must not run out of
        memory after all the denoising); each image lands in a buffer its scope rents."""
        if any(s.closed for s in states):
            raise ValueError("a closed request cannot be decoded")
        check_group(states)
        for start in range(0, len(states), count := per_call(states)):
            self._decode(states[start : start + count])
        return [s.image for s in states]

    def _pixels(self, latents: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
        """[N, 3, H, W] in [0, 1] (a video's [N, 3, F, H, W]), one VAE call."""
        latents = self.family.decoded_latents(latents.to(self.encoder_device, self.vae.dtype), request)
        with self.lane.idle_cores(self.lane_threads) as wider:  # alone: the idle cores too, eagerly
            pixels = run_decoder(self.vae, latents) if wider else self.decoder(latents)
        return (pixels / 2 + 0.5).clamp(0, 1)

    def _decode(self, states: Sequence[RequestState]) -> None:
        latents, request = torch.cat([s.latents for s in states]), states[0].request
        pixels = self._pixels(latents, request)
        if self.sound_parts:  # the sound of a model that makes one, beside its frames
            waves = self.family.sound(self.sound_parts, latents.to(self.encoder_device), request)
            for state, wave in zip(states, waves, strict=True):
                state.sound = wave.float().cpu()
        pinned = self.encoder_device.type == "cuda"
        for state, image in zip(states, pixels, strict=True):
            image = state.frames_last(image)
            state.image = state.scope.rent(image.shape, torch.float32, "cpu", pinned=pinned)
            state.image.copy_(image, non_blocking=pinned)
        if pinned:
            wait_for_queued([str(self.encoder_device)])  # the copies to pinned memory
        for state in states:  # on the CPU, once copied: an inpainting's unmasked pixels, its image's
            keep_unmasked(state.image, state.request.edit)

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
        states = self.start([self.resolve(r) for r in requests])
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
