"""ModelShard: run one denoiser across several devices, moving activations only between stages.

Each block is moved to its stage's device; the block walker (`walker.py`) runs the blocks in
order and moves what crosses a boundary to the next stage's device, once per call.
accelerate, by contrast, hooks every leaf module (hundreds on a UNet).

Several threads may call one shard at once (the lanes of the step loop, micro-batches): stage
gates (`gates.py`) let each stage run one call at a time, so the stages work on different
micro-batches together instead of waiting for each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from server.engine.denoisers.blocks import (
    DenoiserInputs,
    Flow,
    TensorSplit,
    block_modules,
    part,
    tensor_bytes,
)
from server.engine.denoisers.specs import layout_of, spec_for
from server.engine.hardware.devices import format_bytes, worker_names
from server.engine.hardware.memory import DeviceMemory, read_memory
from server.engine.planning.plan import ShardPlan
from server.engine.runtime.call import CallPlan, CallResult, RowsSlot
from server.engine.runtime.compile import CompiledDenoiser, CompileMode
from server.engine.runtime.gates import StageGates
from server.engine.runtime.graphs import GraphStore
from server.engine.runtime.sequence import Rank
from server.engine.runtime.walker import TransferCache, walk
from server.errors import PlanError

log = logging.getLogger("diffshard")


class ModelShard:
    """`model` split across devices by `plan`; call it like the denoiser, or `run` a call plan.

    >>> shard = ModelShard(unet, plan_shards(unet, "cuda:0,cuda:1", "cost"))
    >>> eps = shard(latents, timesteps, text_embeddings)  # on cuda:0

    Threads may call it at once: the stage gates let one call at a time run each stage.
    `workers` names the stages in the gates' books (default: their devices, indexed where one
    repeats).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: ShardPlan,
        workers: Sequence[str] | None = None,
        placed: Callable[[nn.Module, str], object] | None = None,
    ) -> None:
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
        self.spec = spec_for(model)
        self.layout = layout
        self.calls = self.spec.calls(model)  # each block's call, in order
        self.boundary = self.spec.boundary(model)  # where step caching cuts it (None: it cannot)
        self.sequence = self.spec.sequence(model)  # what a sequence group splits (None: nothing)
        self.tensor: TensorSplit | None = None  # a tensor group's rank: what its blocks hold a share of
        self.gates = StageGates(workers or worker_names([stage.device for stage in plan.stages]))
        self.slots = [RowsSlot() for _ in plan.stages]  # per stage: the adapter rows of its call
        self.compiled: CompiledDenoiser | None = None  # set by `compile`
        # 2. Place every block on its stage's device; `placed(module, path)` right after each
        #    (float8 converts there, before the next block moves: the device never holds more
        #    than one block unconverted).
        self.stage_of: dict[str, int] = {}
        self._owner: dict[str, int] = {}  # module path → its stage
        for index, stage in enumerate(plan.stages):
            for block in stage.blocks:
                self.stage_of[block] = index
                for path in layout.blocks[layout.names.index(block)].modules:
                    module = part(model, path)
                    module.to(stage.device)
                    if placed is not None and isinstance(module, nn.Module):
                        placed(module, path)
                    self._owner[path] = index
        self.stage_devices = [torch.device(stage.device) for stage in plan.stages]
        self.device = self.stage_devices[0]
        self.devices = list(dict.fromkeys(stage.device for stage in plan.stages))  # once, not per call

    def __call__(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        context: torch.Tensor,
        **conditioning: object,
    ) -> torch.Tensor:
        """One plain conditional forward; `timestep` is a scalar or a `[B]` tensor. Returns on
        `self.device`."""
        inputs = DenoiserInputs(sample, timestep, context, dict(conditioning))
        return self.run(inputs, CallPlan.plain(sample.shape[0])).out

    def run(self, inputs: DenoiserInputs, plan: CallPlan, rank: Rank | None = None) -> CallResult:
        """One call of `plan` (its rows' adapters, step caching, compile) on `inputs`; as `rank`
        of a sequence group, on its slice of the tokens."""
        with torch.inference_mode():
            return walk(self, inputs, plan, rank=rank)

    def slot_of(self, layer: str) -> RowsSlot:
        """The slot the adapter hook of module `layer` (a dotted path) reads: its stage's."""
        parts = layer.split(".")
        for end in range(len(parts), 0, -1):
            stage = self._owner.get(".".join(parts[:end]))
            if stage is not None:
                return self.slots[stage]
        raise KeyError(f"{layer} is in no block of {type(self.model).__name__}")

    def compile(self, mode: CompileMode, store: GraphStore) -> None:
        """Run calls through graphs compiled per bucket (`warm` makes each ready)."""
        if mode == CompileMode.OFF:
            self.compiled = None
        else:
            self.compiled = CompiledDenoiser(
                self.model, self.spec, self.calls, mode, [s.device for s in self.plan.stages], store
            )

    def warm(self, inputs: DenoiserInputs, rows: int) -> list[tuple[str, tuple]]:
        """Compile (or load from the cache) the bucket of these inputs padded to `rows` rows; the
        graphs added (`CompiledDenoiser.drop` takes them)."""
        if self.compiled is None:
            raise ValueError("the shard is not compiled: call compile() first")
        if inputs.sample.shape[0] != rows:
            raise ValueError(f"warm() takes inputs of the bucket's {rows} rows")
        inputs = DenoiserInputs(*TransferCache().move(tuple(vars(inputs).values()), self.device))
        if self.compiled.mode == CompileMode.FULL:
            return self.compiled.warm_whole(inputs, rows)
        captured: dict[str, Flow] = {}  # each block's inputs as its stage sees them
        plan = replace(CallPlan.plain(rows), compiled=False)
        with torch.inference_mode():
            walk(self, inputs, plan, on_block=lambda name, flow: captured.setdefault(name, flow))
        return self.compiled.warm_blocks(captured, rows)

    # Introspection: where every block and byte lives.

    def blocks_on(self, device: str) -> tuple[str, ...]:
        return self.plan.blocks_on(device)

    def device_of(self, block: str) -> str:
        return self.plan.device_of(block)

    def param_bytes(self) -> dict[str, int]:
        """Bytes of parameters and buffers held per device, counted from the live tensors."""
        held = dict.fromkeys(self.devices, 0)
        for block, module in block_modules(self.model, self.layout):
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
