"""ModelShard: run one denoiser across several devices, moving activations only between stages.

Each block is moved to its stage's device. Blocks of the first stage need nothing more:
the shard moves the inputs there before calling the model's own, unchanged forward.
Every block of a later stage gets one small pre-forward hook that moves the tensors it
is called with to its device. The denoiser's forward passes the same timestep embedding,
text context and skip residuals to many blocks, so each hook goes through a per-call
transfer cache: a tensor crosses to a device once per forward, not once per block.
accelerate, by contrast, hooks every leaf module (hundreds on a UNet).

Several threads may call one shard at once (the lanes of the step loop, micro-batches): stage
gates (`gates.py`) let each stage run one forward at a time, so the stages work on different
micro-batches together instead of waiting for each other.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from server.engine.blocks import DenoiserInputs, block_modules, tensor_bytes
from server.engine.compile import CompiledDenoiser, CompileMode
from server.engine.devices import format_bytes
from server.engine.gates import StageGates, worker_names
from server.engine.graphs import GraphStore
from server.engine.memory import DeviceMemory, read_memory
from server.engine.plan import ShardPlan
from server.engine.specs import layout_of, spec_for
from server.engine.stepcache import RowGroup, Subset, no_subset, walk_for
from server.errors import PlanError

log = logging.getLogger("diffshard")

# Conditioning that forward adds onto tensors of several blocks outside any block: a single
# device plan passes it through, a multi-device one cannot place the sums.
_CROSS_BLOCK_RESIDUALS = (
    "down_block_additional_residuals",
    "mid_block_additional_residual",
    "down_intrablock_additional_residuals",
    "block_controlnet_hidden_states",  # an MMDiT controlnet's: added outside any block
    "controlnet_block_samples",  # FLUX.1 controlnets': likewise
    "controlnet_single_block_samples",
)


class _TransferCache:
    """Copies made during one forward, keyed by (source tensor, device)."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def move(self, obj: Any, device: torch.device) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device == device:
                return obj
            key = (id(obj), device)
            hit = self._copies.get(key)
            if hit is None:  # keep the source alive so its id is not reused this forward
                hit = self._copies[key] = (obj, obj.to(device))
            return hit[1]
        if isinstance(obj, tuple):
            return tuple(self.move(item, device) for item in obj)
        if isinstance(obj, list):
            return [self.move(item, device) for item in obj]
        if isinstance(obj, dict):
            return {key: self.move(value, device) for key, value in obj.items()}
        return obj

    def clear(self) -> None:
        self._copies.clear()


class ModelShard:
    """`model` split across devices by `plan`; call it like the denoiser.

    >>> shard = ModelShard(unet, plan_shards(unet, "cuda:0,cuda:1", "cost"))
    >>> eps = shard(latents, timesteps, text_embeddings)  # on cuda:0

    Threads may call it at once: each has its own transfer cache, and the stage gates let one
    forward at a time run each stage. `workers` names the stages in the gates' books (default:
    their devices, indexed where one repeats).
    """

    def __init__(self, model: nn.Module, plan: ShardPlan, workers: Sequence[str] | None = None) -> None:
        # 1. The plan must be for this model, and the model must have weights.
        layout = layout_of(model)
        if plan.blocks != layout.names:
            raise PlanError(
                f"the plan's blocks {list(plan.blocks)} are not this model's {list(layout.names)}"
            )
        if any(p.is_meta for p in model.parameters()):
            raise PlanError("the model has no weights (meta device): load them before sharding")
        self.model = model
        self.plan = plan
        self._spec = spec_for(model)
        self._layout = layout
        self._modules = {block.name: block.modules for block in layout.blocks}
        self._local = threading.local()  # each calling thread's transfer cache
        self._handles: list[RemovableHandle] = []
        self.gates = StageGates(workers or worker_names([stage.device for stage in plan.stages]))
        self.compiled: CompiledDenoiser | None = None  # set by `compile`

        # 2. Place every block; with several stages, hook their blocks: a forward reaching a
        # stage takes its gate, and (after the first) moves its inputs to the stage's device.
        for index, stage in enumerate(plan.stages):
            device = torch.device(stage.device)
            for block in stage.blocks:
                for path in self._modules[block]:
                    module = model.get_submodule(path).to(device)
                    if len(plan.stages) > 1:
                        self._handles.append(
                            module.register_forward_pre_hook(self._entry(index, device), with_kwargs=True)
                        )
        self.device = torch.device(plan.stages[0].device)
        self.devices = list(dict.fromkeys(stage.device for stage in plan.stages))  # once, not per call

    @property
    def _cache(self) -> _TransferCache:
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = _TransferCache()
        return cache

    def _entry(self, index: int, device: torch.device):
        def enter_stage(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            self.gates.enter(index)
            if index == 0:
                return None  # the inputs were moved to the first stage's device by __call__
            return self._cache.move(args, device), self._cache.move(kwargs, device)

        return enter_stage

    def __call__(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        context: torch.Tensor,
        **conditioning: Any,
    ) -> torch.Tensor:
        """One conditional forward; `timestep` is a scalar or a `[B]` tensor. Returns on `self.device`."""
        if len(self.devices) > 1 and any(conditioning.get(k) is not None for k in _CROSS_BLOCK_RESIDUALS):
            names = ", ".join(_CROSS_BLOCK_RESIDUALS)
            raise ValueError(f"{names} need a plan on one device; this one spans {self.devices}")
        with self._forward(DenoiserInputs(sample, timestep, context, conditioning)) as inputs:
            out = self.compiled.run(inputs) if self.compiled is not None else None
            if out is None:  # not compiled, or no bucket holds this call
                with torch.inference_mode():
                    out = self._spec.forward(self.model, inputs)
            return out.to(self.device)

    def cached(
        self, inputs: DenoiserInputs, groups: Sequence[RowGroup], subset: Subset = no_subset
    ) -> torch.Tensor | None:
        """One forward with step caching (`stepcache.py`): each group of rows refreshes or reuses
        what it kept; eager, whatever `compile` set. None where the model or these inputs have no
        cached walk: call the shard plainly then."""
        walk = walk_for(self.model, inputs)
        if walk is None:
            return None
        with self._forward(inputs) as moved, torch.inference_mode():
            return walk(self.model, moved, groups, subset).to(self.device)

    @contextmanager
    def _forward(self, inputs: DenoiserInputs) -> Iterator[DenoiserInputs]:
        """One forward's bracket: the inputs moved to the first stage, the gates' books, and the
        transfer cache cleared and the gate let go on every path (a failed input move included)."""
        move = self._cache.move
        self.gates.begin()
        try:
            if len(self.plan.stages) == 1:
                self.gates.enter(0)
            yield DenoiserInputs(*(move(x, self.device) for x in vars(inputs).values()))
        finally:
            self.gates.end()
            self._cache.clear()

    def compile(self, mode: CompileMode, store: GraphStore, shared: CompiledDenoiser | None = None) -> None:
        """Run calls through graphs compiled per bucket (`warm` makes each ready); replicas that
        share one model share its `shared` graphs."""
        if mode == CompileMode.OFF:
            self.compiled = None
        elif shared is not None and shared.model is self.model:
            self.compiled = shared
        else:
            self.compiled = CompiledDenoiser(
                self.model, self._spec, self._layout, mode, len(self.plan.stages), store
            )

    def warm(self, inputs: DenoiserInputs, rows: int) -> None:
        """Compile (or load from the cache) the bucket of these inputs padded to `rows` rows."""
        if self.compiled is None:
            raise ValueError("the shard is not compiled: call compile() first")
        with self._forward(inputs) as moved:
            self.compiled.warm(moved, rows)

    # Introspection: where every block and byte lives.

    def blocks_on(self, device: str) -> tuple[str, ...]:
        return self.plan.blocks_on(device)

    def device_of(self, block: str) -> str:
        return self.plan.device_of(block)

    def param_bytes(self) -> dict[str, int]:
        """Bytes of parameters and buffers held per device, counted from the live tensors."""
        held = dict.fromkeys(self.devices, 0)
        for block, module in block_modules(self.model, self._layout):
            held[self.device_of(block)] += tensor_bytes(module)
        return held

    def memory(self) -> dict[str, DeviceMemory]:
        """A reading per device; a device that cannot be read (a broken GPU) gives only its bytes,
        so one failing device does not take the others' readings (or a metrics scrape) with it."""
        readings = {}
        for device, nbytes in self.param_bytes().items():
            try:
                readings[device] = read_memory(device, nbytes)
            except Exception as err:
                log.warning("cannot read the memory of %s: %s", device, err)
                readings[device] = DeviceMemory(device, nbytes)
        return readings

    def remove(self) -> None:
        """Take the hooks off; the blocks stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> ModelShard:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"ModelShard({type(self.model).__name__}, stages={[s.device for s in self.plan.stages]})"

    def __str__(self) -> str:
        lines = [repr(self)]
        for device, m in self.memory().items():
            line = f"  {device}: {len(self.blocks_on(device))} blocks, holds {format_bytes(m.shard_bytes)}"
            if m.allocated is not None:
                line += f"; allocated {format_bytes(m.allocated)}, reserved {format_bytes(m.reserved or 0)}"
                line += f", free {format_bytes(m.free or 0)} of {format_bytes(m.total or 0)}"
            lines.append(line)
        return "\n".join([*lines, str(self.plan)])
