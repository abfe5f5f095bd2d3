"""LoRA adapters applied per row: one denoiser (or text-encoder) call carries rows with different
adapters, or none, and each targeted layer adds `scale · B(A x)` to its own rows only.

Files are read with diffusers' own loaders (`lora_keys.py`), safetensors only. The base weights
are never touched: a forward hook on each targeted `nn.Linear` or `nn.Conv2d` adds the adapters'
deltas to its output; a call with no row asking for them runs exactly as the base model, and in
a mixed call a row without adapters gets a delta of exactly 0.

Why not peft's layers: its mixed-batch forward (`adapter_names`) takes one adapter per row at
that adapter's one global scale; a request here may ask for several adapters, each at its own
scale, beside other requests asking for the same adapter at another. Per layer, the adapters
are stacked (`Stacked`): one product down through every adapter's A, each row's scales applied
(0 for adapters it did not ask for), one product up: a fixed number of ops whatever the mix.

Which rows ask for what travels in each call's plan; the block walker leaves it in the slot of
the stage it runs (`RowsSlot`: a stage runs one call at a time), and each layer's hook reads its
stage's slot. Every replica has its own module tree, so replicas sharing weights do not see
each other's rows. A call whose batch is not the slot's rows raises (`RowsMismatch`): adapters
silently skipped would be a wrong image. Adapters attach and detach at runtime under
`adapters.CHANGES`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from server.engine.quantize import layer_dtype, layer_features
from server.engine.runtime.call import RowsSlot
from server.engine.runtime.tensor import RowLinear
from server.engine.runtime.tracing import compiling_here
from server.errors import ModelFolderError
from server.pipeline.conditioning.live_changes import CHANGES, RowsMismatch, Uses

SlotOf = Callable[[str], RowsSlot]  # a layer's dotted path → the slot its hook reads


@dataclass(frozen=True)
class Target:
    """A model adapters attach to, and where its layers' hooks find the rows of a call."""

    model: nn.Module
    slot_of: SlotOf


@dataclass(frozen=True)
class Stacked:
    """One layer's adapters, their pairs stacked: one product down and one up for any mix of
    adapters in the call, each row's scales applied between (as S-LoRA batches adapters)."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    down: torch.Tensor  # [sum of ranks, in] (conv: [sum, in, kh, kw])
    up: torch.Tensor  # [out, sum of ranks] (conv: [out, sum, 1, 1]), alpha / rank folded in

    @classmethod
    def of(cls, pairs: Mapping[str, LoraPair]) -> Stacked:
        ups = [pair.up * pair.scaling for pair in pairs.values()]
        return cls(
            tuple(pairs),
            tuple(pair.rank for pair in pairs.values()),
            torch.cat([pair.down for pair in pairs.values()]),
            torch.cat(ups, dim=1),
        )


@dataclass(frozen=True)
class LoraPair:
    """One targeted layer of one adapter: `up @ down`, times `alpha / rank` (rsLoRA, peft's
    `use_rslora`: `alpha / √rank`)."""

    down: torch.Tensor  # lora_A: [rank, in] (conv: [rank, in, kh, kw])
    up: torch.Tensor  # lora_B: [out, rank] (conv: [out, rank, 1, 1])
    alpha: float
    rslora: bool = False

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass
class Adapter:
    """A LoRA file, read: per part of the pipeline ("unet", "text_encoder", ...), per module name,
    its pair."""

    name: str
    path: Path
    parts: dict[str, dict[str, LoraPair]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(pair.rank for pairs in self.parts.values() for pair in pairs.values())

    @property
    def bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for pairs in self.parts.values()
            for pair in pairs.values()
            for t in (pair.down, pair.up)
        )

    def describe(self) -> dict[str, Any]:
        # a module's path inside its innermost repeated block (`...transformer_blocks.0.attn1.to_q`
        # → `attn1.to_q`, `...ff.net.0.proj` → `ff.net.0.proj`): what a trainer's targets name
        targets = sorted({_INSIDE_BLOCK.sub("", name) for pairs in self.parts.values() for name in pairs})
        return {"name": self.name, "rank": self.rank, "parts": sorted(self.parts), "targets": targets}


_INSIDE_BLOCK = re.compile(r"^.*\b\w+s\.\d+\.")  # up to the last `<plural>.<index>.`


class Adapters:
    """The adapters a pipeline serves, each attached to every copy of the parts it targets
    (`targets`: part name → its models, e.g. one UNet per replica; a copy shared by lanes once)."""

    def __init__(self, targets: Mapping[str, Sequence[Target]]) -> None:
        self.targets = targets
        self.loaded: dict[str, Adapter] = {}
        self.sets: dict[int, AdapterSet] = {}  # id(model) → its adapters
        self.uses = Uses()  # jobs holding each adapter; those being unloaded

    def add(self, adapter: Adapter) -> None:
        """Attach `adapter` everywhere it targets (waits for the calls in flight), or raise
        ModelFolderError with nothing attached."""
        with CHANGES.writing():
            if adapter.name in self.loaded:
                raise ModelFolderError(f"two adapters are named {adapter.name!r}: give each its own name")
            for part in adapter.parts:
                if part not in self.targets:
                    raise ModelFolderError(
                        f"LoRA {adapter.name!r} targets {part}, which this model does not have"
                    )
            for target, part in [(t, p) for p in adapter.parts for t in self.targets[p]]:  # checked first
                AdapterSet(target, part).check(adapter)
            for part in adapter.parts:
                for target in self.targets[part]:
                    self.sets.setdefault(id(target.model), AdapterSet(target, part)).add(adapter)
            self.loaded[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Detach `name` from every model (waits for the calls in flight); its hooks go with it
        where it was a layer's last adapter."""
        with CHANGES.writing():
            self.loaded.pop(name, None)
            for adapter_set in self.sets.values():
                adapter_set.remove(name)
        self.uses.gone(name)

    def release(self, names: set[str]) -> None:
        """A job's end: the leaving adapters it was the last to hold are detached, off this thread
        (a step loop's or the watchdog's: detaching waits for the calls in flight)."""
        for name in self.uses.release(names):
            threading.Thread(target=self.remove, args=(name,), name="diffshard-unload", daemon=True).start()

    def bytes_on(self) -> dict[str, int]:
        out: dict[str, int] = {}
        seen: set[int] = set()  # replicas sharing weights share their adapters' tensors too
        with CHANGES.reading():  # a stats reader: not while an adapter is being attached
            for adapter_set in self.sets.values():
                for device, size in adapter_set.bytes_on(seen).items():
                    out[device] = out.get(device, 0) + size
        return out


class AdapterSet:
    """Adapters attached to one model (a denoiser or a text encoder): a hook per targeted layer,
    placed on that layer's device and dtype. `check` first names the first module that does not
    fit."""

    def __init__(self, target: Target, part: str) -> None:
        self.model, self.slot_of, self.part = target.model, target.slot_of, part
        self.layers: dict[str, dict[str, LoraPair]] = {}  # module name → adapter name → pair
        self.stacked: dict[str, Stacked] = {}  # module name → its adapters, stacked
        self._hooks: dict[str, Any] = {}

    def check(self, adapter: Adapter) -> dict[str, LoraPair]:
        """`adapter`'s pairs for this model by module name (a tensor rank's layer: its part of
        the pair); ModelFolderError at the first misfit."""
        modules = dict(self.model.named_modules())
        pairs = {_named(name, modules): pair for name, pair in adapter.parts.get(self.part, {}).items()}
        for module_name, pair in pairs.items():
            _check_fits(adapter, module_name, modules.get(module_name), pair)
            if (part := getattr(modules[module_name], "rank_part", None)) is not None:
                down, up = part.of_adapter(pair.down, pair.up)
                pairs[module_name] = dataclasses.replace(pair, down=down, up=up)
        return pairs

    def add(self, adapter: Adapter) -> None:
        modules = dict(self.model.named_modules())
        for module_name, pair in self.check(adapter).items():
            layer = modules[module_name]
            device, dtype = layer.weight.device, layer_dtype(layer)
            placed = dataclasses.replace(pair, down=pair.down.to(device, dtype), up=pair.up.to(device, dtype))
            self.layers.setdefault(module_name, {})[adapter.name] = placed
            self.stacked[module_name] = Stacked.of(self.layers[module_name])
            if module_name not in self._hooks:
                hook = self._hook(module_name, self.slot_of(module_name))
                self._hooks[module_name] = layer.register_forward_hook(hook)

    def remove(self, name: str) -> None:
        for module_name in [m for m, by_name in self.layers.items() if name in by_name]:
            del self.layers[module_name][name]
            if self.layers[module_name]:
                self.stacked[module_name] = Stacked.of(self.layers[module_name])
            else:  # no adapter left on this layer: it runs as the base model's, hook-free
                del self.layers[module_name], self.stacked[module_name]
                self._hooks.pop(module_name).remove()

    def bytes_on(self, seen: set[int]) -> dict[str, int]:
        """Adapter bytes per device, of the pairs not in `seen` (ids of their tensors) yet."""
        out: dict[str, int] = {}
        for by_name in self.layers.values():
            for pair in by_name.values():
                if id(pair.down) in seen:
                    continue
                seen.add(id(pair.down))
                device = str(pair.down.device)
                out[device] = out.get(device, 0) + sum(
                    t.numel() * t.element_size() for t in (pair.down, pair.up)
                )
        return out

    def _hook(self, module_name: str, slot: RowsSlot):
        def add_deltas(layer: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            rows = slot.rows
            if rows is None or compiling_here():  # a graph never holds an adapter
                return output
            if len(rows.rows) != output.shape[0]:
                raise RowsMismatch(
                    f"{self.part}.{module_name} got {output.shape[0]} rows under a plan for "
                    f"{len(rows.rows)}: a caller must give the slot the rows it runs"
                )
            stacked = self.stacked[module_name]
            mask = rows.mask(stacked.names, stacked.ranks, output.device, output.dtype)
            if mask is None:  # no row of this call asks for this layer's adapters
                return output
            x = inputs[0]
            if isinstance(layer, nn.Conv2d):
                hidden = F.conv2d(
                    x, stacked.down, stride=layer.stride, padding=layer.padding, dilation=layer.dilation
                )
                hidden.mul_(mask[:, :, None, None])
                return output.add_(F.conv2d(hidden, stacked.up))
            hidden = F.linear(x, stacked.down)
            hidden.mul_(mask.view(mask.shape[0], *([1] * (hidden.dim() - 2)), mask.shape[1]))
            delta = F.linear(hidden, stacked.up)
            if isinstance(layer, RowLinear):  # a tensor rank's part of its inputs: a partial delta
                delta = layer.slot.rank.all_reduce(delta)
            return output.add_(delta)

        return add_deltas


def _named(name: str, modules: Mapping[str, nn.Module]) -> str:
    """A module's name in this model: older files say `text_model.` where transformers 5's flat
    CLIPTextModel has none (diffusers strips it too)."""
    if name not in modules and name.removeprefix("text_model.") in modules:
        return name.removeprefix("text_model.")
    return name


def _check_fits(adapter: Adapter, name: str, layer: nn.Module | None, pair: LoraPair) -> None:
    where = f"LoRA {adapter.name!r} ({adapter.path.name}) does not fit this model: {name}"
    if not isinstance(layer, nn.Linear | nn.Conv2d):
        kind = "no such module" if layer is None else f"a {type(layer).__name__}, not a Linear or Conv2d"
        raise ModelFolderError(f"{where} is {kind}")
    part = getattr(layer, "rank_part", None)  # a tensor rank's layer: the whole one's features
    gives, takes = part.whole if part is not None else layer_features(layer)[::-1]
    if pair.down.shape[1] != takes or pair.up.shape[0] != gives:
        raise ModelFolderError(
            f"{where} maps {takes} features to {gives}, the adapter "
            f"{pair.down.shape[1]} to {pair.up.shape[0]} (rank {pair.rank})"
        )
