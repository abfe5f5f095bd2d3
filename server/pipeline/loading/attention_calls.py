"""The served denoiser's attention backend: its calls in one step of a default request, counted
by device, and PyTorch's SDPA backend for its CUDA devices chosen from them (`--attention`,
`engine/runtime/sdpa_backend.py`).

The calls are counted on the meta device, from a real default request's inputs (its size, its
frames, its prompt's tokens, its guided rows): one forward of a weightless twin, block by block,
each block's calls put on the devices that run that block. A tensor or sequence group's ranks run
a share of the heads or tokens; the whole model's shapes stand for theirs.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter

import torch
from PIL import Image
from torch import nn
from torch.utils._pytree import tree_map

from server.engine.denoisers.blocks import DenoiserInputs, Flow
from server.engine.denoisers.specs import spec_for
from server.engine.runtime.cpu_attention import Recording, Shape
from server.engine.runtime.pool import ActivationPool
from server.engine.runtime.sdpa_backend import AttentionChoice, AttentionSetting, choose, put_first
from server.pipeline.families import meta_denoiser
from server.pipeline.pipeline import Pipeline
from server.requests.generation import GenerationRequest

log = logging.getLogger("diffshard")


def serve_attention(setting: AttentionSetting | str, pipeline: Pipeline) -> AttentionChoice:
    """`setting` on `pipeline`'s CUDA devices: measured (auto) or probed (a backend named), put
    first in PyTorch's order, and said in one log line. Run at startup before anything else
    calls attention: timing forces backends through process-wide flags. ConfigError where a named
    backend cannot run here."""
    devices = denoiser_devices(pipeline)
    cuda = [d for d in devices if torch.device(d).type == "cuda"]
    cpu = len(cuda) < len(devices)
    measures = cuda and AttentionSetting(setting) != AttentionSetting.DEFAULT
    calls = attention_calls(pipeline, cuda) if measures else {}
    choice = choose(setting, calls, cpu=cpu)
    put_first(choice.backend)
    log.info("%s", choice.line())
    return choice


def denoiser_devices(pipeline: Pipeline) -> list[str]:
    """Every device a block of the denoiser runs on (every expert's, every replica's), in order."""
    shards = [shard for deployment in pipeline.experts for shard in deployment.replicas]
    return list(dict.fromkeys(device for shard in shards for device in shard.devices))


def attention_calls(pipeline: Pipeline, devices: list[str]) -> dict[str, Counter[Shape]]:
    """Each of `devices`' plain attention calls in one step of a default request: device → shape
    → calls. Nothing runs on the devices but the request's prompt encoding."""
    # 1. The devices each block runs on (every expert, every replica)
    where: dict[str, set[str]] = {}
    for deployment in pipeline.experts:
        for shard in deployment.replicas:
            for block in shard.plan.blocks:
                where.setdefault(block, set()).add(shard.device_of(block))
    # 2. A default request's inputs, as the step loop stacks them, then on the meta device
    inputs = _default_inputs(pipeline)
    # 3. One forward of the weightless twin, each block's attention counted under its name
    twin = nn.Module.to(meta_denoiser(pipeline.family), pipeline.denoiser_dtype).eval()
    spec = spec_for(twin)
    calls: dict[str, Counter[Shape]] = {device: Counter() for device in devices}
    with torch.inference_mode():
        flow = spec.begin(twin, inputs)
        for name, call in spec.calls(twin).items():
            with Recording(device="meta", keywords=True) as recording:
                flow = Flow(call.fn(call.owner, flow.rows, flow.shared), flow.shared)
            for device in where.get(name, ()):
                if device in calls:
                    calls[device].update(recording.calls)
    return calls


def _default_inputs(pipeline: Pipeline) -> DenoiserInputs:
    """The denoiser's inputs for a request naming nothing (a video model's: its default clip), on
    the meta device."""
    # a pool of its own: these buffers are no request's, and must not read as the service's
    pipeline = copy.copy(pipeline)
    pipeline.pool = ActivationPool()
    clip, defaults = pipeline.family.clip, pipeline.defaults
    size = defaults.video_size if clip is not None and defaults.video_size else (defaults.size,) * 2
    frame = Image.new("RGB", size) if pipeline.family.takes_reference else None  # image-to-video
    asked = GenerationRequest("attention", frames=clip.frames if clip else None, reference=frame)
    (state,) = pipeline.start([pipeline.resolve(pipeline.with_defaults(asked))])
    try:
        with pipeline.pool.scope() as batch, torch.inference_mode():
            return _meta(pipeline.stacked([state], batch))
    finally:
        state.close()


def _meta(inputs: DenoiserInputs) -> DenoiserInputs:
    def meta(leaf: object) -> object:  # shape and dtype alone (a simulated GPU's tensor keeps no other)
        return (
            torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
            if isinstance(leaf, torch.Tensor)
            else leaf
        )

    return DenoiserInputs(*(tree_map(meta, value) for value in vars(inputs).values()))
