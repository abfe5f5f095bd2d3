"""LoRA adapters applied per row: one denoiser (or text-encoder) call carries rows with different
adapters, or none, and each targeted layer adds `scale · B(A x)` to its own rows only.

Files are read with diffusers' own loaders (`lora_state_dict`: diffusers/PEFT keys, and kohya's
A1111 format converted), safetensors only. The base weights are never touched: a forward hook on
each targeted `nn.Linear` or `nn.Conv2d` adds the adapters' deltas to its output; a call with no
row asking for them runs exactly as the base model, and in a mixed call a row without adapters
gets a delta of exactly 0.

Why not peft's layers: its mixed-batch forward (`adapter_names`) takes one adapter per row at
that adapter's one global scale; a request here may ask for several adapters, each at its own
scale, beside other requests asking for the same adapter at another. Per layer, the adapters
are stacked (`Stacked`): one product down through every adapter's A, each row's scales applied
(0 for adapters it did not ask for), one product up: a fixed number of ops whatever the mix.

Which rows ask for what is set around each call (`rows_asking`), per thread: each step loop's
thread runs its own calls, so lanes sharing one copy of the weights do not see each other's.
"""

from __future__ import annotations

import difflib
import json
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
)
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from server.errors import ModelFolderError
from server.pipeline.families import Family

Choice = tuple[tuple[str, float], ...]  # a request's adapters: (name, scale), in order

_asking = threading.local()  # .plan: the RowPlan of the call in flight on this thread


class RowPlan:
    """Which rows of one call ask for which adapter, at what scale. Per set of adapters a layer
    holds, a mask [rows, their ranks stacked] of each row's scale, made once per call and device
    (not once per layer)."""

    def __init__(self, rows: Sequence[Choice]) -> None:
        self.rows = rows
        self._masks: dict[tuple, torch.Tensor | None] = {}

    def mask(self, stacked: Stacked, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """[rows, sum of ranks]: a row's scale for each adapter's columns (0: not asked); None if
        no row asks for any of `stacked`'s adapters."""
        key = (stacked.names, stacked.ranks, device, dtype)
        if key not in self._masks:
            scales = [dict(choice) for choice in self.rows]
            per_column = [
                [s.get(n, 0.0) for n, r in zip(stacked.names, stacked.ranks, strict=True) for _ in range(r)]
                for s in scales
            ]
            asked = any(n in s for s in scales for n in stacked.names)
            self._masks[key] = torch.tensor(per_column, device=device, dtype=dtype) if asked else None
        return self._masks[key]


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
    """One targeted layer of one adapter: `up @ down`, times `alpha / rank`."""

    down: torch.Tensor  # lora_A: [rank, in] (conv: [rank, in, kh, kw])
    up: torch.Tensor  # lora_B: [out, rank] (conv: [out, rank, 1, 1])
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


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


def read_adapter(name: str, path: Path, family: Family) -> Adapter:
    """`path` (a .safetensors file) as an Adapter for a model of `family`, read by its diffusers
    pipeline class's `lora_state_dict`; ModelFolderError says what does not fit."""
    pipeline_class = getattr(diffusers, family.pipeline_classes[0])
    parts = (family.denoiser, *family.text_encoders)
    if path.suffix != ".safetensors" or not path.is_file():
        raise ModelFolderError(f"LoRA {name!r}: {path} is not a .safetensors file")
    raw = load_file(path)
    with safe_open(path, "pt") as header:
        metadata = json.loads((header.metadata() or {}).get("lora_adapter_metadata", "{}") or "{}")
    read = pipeline_class.lora_state_dict(raw)  # diffusers converts kohya's keys
    # SD and SDXL give (state, network alphas); SD3's loader, the state alone
    state, alphas = read if isinstance(read, tuple) else (read, None)
    adapter = Adapter(name, path)
    by_part: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        part, _, inner = key.partition(".")
        if part not in parts or not inner:
            raise ModelFolderError(
                f"LoRA {name!r}: {path.name} targets {key!r}, which is not a part of this model "
                f"({', '.join(parts)})"
            )
        by_part.setdefault(part, {})[inner] = tensor
    for part, tensors in by_part.items():
        text = part != family.denoiser
        part_alphas = {
            k.removeprefix(f"{part}."): v for k, v in (alphas or {}).items() if k.startswith(f"{part}.")
        }
        pairs, module_alphas = (
            _pairs(_as_peft(tensors, text), f"LoRA {name!r}: {path.name}"),
            _alphas_by_module(part_alphas, text),
        )
        config = _part_config(metadata, part)
        for module, pair in pairs.items():
            if set(pair) != {"down", "up"}:
                raise ModelFolderError(f"LoRA {name!r}: {path.name} has half of a pair at {part}.{module}")
            rank = pair["down"].shape[0]
            alpha = module_alphas.get(module)
            if alpha is None:
                alpha = _configured_alpha(config, module, rank)
            adapter.parts.setdefault(part, {})[module] = LoraPair(pair["down"], pair["up"], float(alpha))
    if not adapter.parts:
        raise ModelFolderError(f"LoRA {name!r}: {path.name} holds no LoRA weights")
    return adapter


def _part_config(metadata: dict[str, Any], part: str) -> dict[str, Any]:
    """A part's peft config from diffusers' `lora_adapter_metadata`: `save_lora_weights` prefixes
    each key with its part (`unet.lora_alpha`, `text_encoder.alpha_pattern`); a file written for
    one model alone may hold them bare."""
    prefixed = {k.removeprefix(f"{part}."): v for k, v in metadata.items() if k.startswith(f"{part}.")}
    return prefixed or {k: v for k, v in metadata.items() if "." not in k}


def _configured_alpha(config: dict[str, Any], module: str, rank: int) -> float:
    """The module's lora_alpha as peft reads a LoraConfig: its `alpha_pattern` entry (a key that
    matches the module name's tail, as peft's `get_pattern_key`), else `lora_alpha`, else the rank
    (the scaling is then 1)."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config.get("lora_alpha", rank))


def _as_peft(tensors: dict[str, Any], text: bool) -> dict[str, Any]:
    """A part's keys in PEFT's form (`<module>.lora_A.weight`), converted as diffusers' loaders do
    (older diffusers and kohya-converted keys: `processor.to_k_lora.down.weight`, ...)."""
    if all(".lora_A." in key or ".lora_B." in key for key in tensors):
        return tensors
    if text:
        return convert_state_dict_to_peft(convert_state_dict_to_diffusers(tensors))
    return convert_unet_state_dict_to_peft(tensors)


def _alphas_by_module(alphas: dict[str, float], text: bool) -> dict[str, float]:
    """kohya's alphas (keyed by the converted down weight + `.alpha`) by module: their keys go
    through the same conversion as the weights'."""
    weights = [key.removesuffix(".alpha") for key in alphas]
    converted = _as_peft(dict.fromkeys(weights, 0), text)
    return {key.split(".lora_")[0]: alpha for key, alpha in zip(converted, alphas.values(), strict=True)}


def _pairs(tensors: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """PEFT-form tensors by module: {"down": lora_A, "up": lora_B}; `where` names the file."""
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.partition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ModelFolderError(f"{where} has a key diffshard cannot read: {key}")
        pairs.setdefault(module, {})["down" if kind == "A.weight" else "up"] = tensor
    return pairs


class Adapters:
    """The adapters a pipeline serves, each attached to every copy of the parts it targets
    (`models`: part name → its models, e.g. one UNet per replica; a copy shared by lanes once)."""

    def __init__(self, models: Mapping[str, Sequence[nn.Module]]) -> None:
        self.models = models
        self.loaded: dict[str, Adapter] = {}
        self.sets: dict[int, AdapterSet] = {}  # id(model) → its adapters

    def add(self, adapter: Adapter) -> None:
        if adapter.name in self.loaded:
            raise ModelFolderError(f"two adapters are named {adapter.name!r}: give each its own name")
        for part in adapter.parts:
            if part not in self.models:
                raise ModelFolderError(
                    f"LoRA {adapter.name!r} targets {part}, which this model does not have"
                )
        for part in adapter.parts:
            for model in self.models[part]:
                self.sets.setdefault(id(model), AdapterSet(model, part)).add(adapter)
        self.loaded[adapter.name] = adapter

    def bytes_on(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for adapter_set in self.sets.values():
            for device, size in adapter_set.bytes_on().items():
                out[device] = out.get(device, 0) + size
        return out


def unknown_adapter(name: str, loaded: Mapping[str, Adapter]) -> str:
    """What to tell a request asking for an adapter not served: the nearest name, and those loaded."""
    if not loaded:
        return f"no adapter named {name!r}: this server loads none (serve --lora NAME=FILE)"
    close = difflib.get_close_matches(name, loaded, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return f"no adapter named {name!r}{hint} Loaded: {', '.join(sorted(loaded))} (GET /v1/models)"


class AdapterSet:
    """Adapters attached to one model (a denoiser or a text encoder): a hook per targeted layer,
    placed on that layer's device and dtype. `check` first names the first module that does not
    fit."""

    def __init__(self, model: nn.Module, part: str) -> None:
        self.model, self.part = model, part
        self.layers: dict[str, dict[str, LoraPair]] = {}  # module name → adapter name → pair
        self.stacked: dict[str, Stacked] = {}  # module name → its adapters, stacked
        self._hooks: dict[str, Any] = {}

    def add(self, adapter: Adapter) -> None:
        modules = dict(self.model.named_modules())
        pairs = {_named(name, modules): pair for name, pair in adapter.parts.get(self.part, {}).items()}
        for module_name, pair in pairs.items():  # all checked before any is attached
            _check_fits(adapter, module_name, modules.get(module_name), pair)
        for module_name, pair in pairs.items():
            layer = modules[module_name]
            weight = layer.weight
            placed = LoraPair(
                pair.down.to(weight.device, weight.dtype), pair.up.to(weight.device, weight.dtype), pair.alpha
            )
            self.layers.setdefault(module_name, {})[adapter.name] = placed
            self.stacked[module_name] = Stacked.of(self.layers[module_name])
            if module_name not in self._hooks:
                self._hooks[module_name] = layer.register_forward_hook(self._hook(module_name))

    def bytes_on(self) -> dict[str, int]:
        """Adapter bytes per device."""
        out: dict[str, int] = {}
        for by_name in self.layers.values():
            for pair in by_name.values():
                device = str(pair.down.device)
                out[device] = out.get(device, 0) + sum(
                    t.numel() * t.element_size() for t in (pair.down, pair.up)
                )
        return out

    def _hook(self, module_name: str):
        def add_deltas(layer: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            plan: RowPlan | None = getattr(_asking, "plan", None)
            if plan is None or len(plan.rows) != output.shape[0]:
                return output
            stacked = self.stacked[module_name]
            mask = plan.mask(stacked, output.device, output.dtype)
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
            return output.add_(F.linear(hidden, stacked.up))

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
    weight = layer.weight
    if pair.down.shape[1] != weight.shape[1] or pair.up.shape[0] != weight.shape[0]:
        raise ModelFolderError(
            f"{where} maps {weight.shape[1]} features to {weight.shape[0]}, the adapter "
            f"{pair.down.shape[1]} to {pair.up.shape[0]} (rank {pair.rank})"
        )


@contextmanager
def rows_asking(rows: Sequence[Choice]) -> Iterator[None]:
    """Within: the calls on this thread carry `rows` (one Choice per row of their batch)."""
    before = getattr(_asking, "plan", None)
    _asking.plan = RowPlan(rows) if any(rows) else None
    try:
        yield
    finally:
        _asking.plan = before
