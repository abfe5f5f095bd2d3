"""ControlNets per row: a request's controls (`Control`: a served ControlNet, its image, scale and
step window), each one's image as diffusers' ControlNet pipelines prepare it, and a call's
residuals. Each ControlNet runs once a step, on the rows that ask for it then (each row its own
image, scale and window); its residuals are scaled per row and added to those rows only, zeros
elsewhere, so a row without a control draws exactly what it draws in a call without one. Several
controls on a row add up, as diffusers' Multi-ControlNet sums them. What differs by family (how
its pipeline prepares a control image, how its net is called, the residuals' names) is the
family's (`Family.control_image`, `control_residuals`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from torch import nn

from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.hardware.devices import host_values
from server.errors import InvalidRequest
from server.pipeline.conditioning.live_changes import Uses, runtime_path, unknown
from server.requests.control import MAX_CONTROLS, MAX_SCALE, Control

# what a ControlNet shares with the denoiser it was made for (its residuals' shapes, its inputs)
SHARED_CONFIG = (
    "in_channels",
    "block_out_channels",
    "cross_attention_dim",
    "addition_embed_type",  # a UNet's
    "joint_attention_dim",
    "pooled_projection_dim",
    "guidance_embeds",  # FLUX.1's (its width: the family's)
)


@dataclass(frozen=True)
class RowControl:
    """A control on one request's rows: its image, prepared, on every row."""

    control: Control
    image: torch.Tensor  # [rows, ...] as the family's net takes it (`Family.control_image`)


class ControlNets:
    """The ControlNets a pipeline serves, by name, on its first stage's device."""

    def __init__(
        self, family: Any, device: torch.device, dtype: torch.dtype, denoiser: Mapping[str, Any] | None = None
    ) -> None:
        self.family, self.device, self.dtype = family, device, dtype
        self.denoiser = denoiser or {}  # the denoiser's config, which a ControlNet's must fit
        # replaced whole on a change (runtime loads): a step reading it never sees it change
        self.loaded: dict[str, nn.Module] = {}
        self.uses = Uses("control", "ControlNet")  # jobs holding each, and those unloading
        self._adding = threading.Lock()

    def load(self, name: str, folder: Path) -> None:
        """The ControlNet in `folder` (`controlnet_folder`'s) served as `name`; ValueError naming
        it if it is not one this model's family takes."""
        config = json.loads((folder / "config.json").read_text())
        kind = config["_class_name"]
        self._fits(name, kind, config)
        # in the served dtype as it loads: diffusers keeps a net's float32 modules so (a cast after
        # loading warns that it cannot, on every start)
        net = getattr(diffusers, kind).from_pretrained(folder, use_safetensors=True, torch_dtype=self.dtype)
        self.add(name, net)

    def add(self, name: str, net: nn.Module) -> None:
        self._fits(name, type(net).__name__, getattr(net, "config", {}))
        net = net.to(self.device).eval()
        if net.dtype != self.dtype:
            net = net.to(dtype=self.dtype)
        with self._adding:
            if name in self.loaded:
                raise ValueError(f"a ControlNet named {name!r} is served (or still unloading)")
            self.loaded = {**self.loaded, name: net}

    def remove(self, name: str) -> None:
        """Stop holding `name` (no job uses it now: `Uses`)."""
        with self._adding:
            self.loaded = {k: v for k, v in self.loaded.items() if k != name}
        self.uses.gone(name)

    def hold(self, names: set[str]) -> None:
        """A job's ControlNets, held until `release`; InvalidRequest if one is unloading or gone."""
        self.uses.hold(names, served=lambda name: name in self.loaded)

    def release(self, names: set[str]) -> None:
        """A job's end: the unloading ControlNets it was the last to hold go now."""
        for name in self.uses.release(names):
            self.remove(name)

    def _fits(self, name: str, kind: str, config: Mapping[str, Any]) -> None:
        if kind not in self.family.controlnets:
            takes = ", ".join(self.family.controlnets) or "none"
            raise ValueError(f"ControlNet {name!r} is a {kind}: a {self.family.name} model takes {takes}")
        if refusal := self.family.control_refusal(dict(config)):
            raise ValueError(f"ControlNet {name!r}: {refusal}")
        for key in SHARED_CONFIG:
            mine, theirs = _listed(config.get(key)), _listed(self.denoiser.get(key))
            if key in config and key in self.denoiser and mine != theirs:
                raise ValueError(
                    f"ControlNet {name!r} was made for another model: its {key} is {mine}, "
                    f"the denoiser's {theirs}"
                )

    def describe(self) -> list[dict[str, Any]]:
        """What /v1/models lists: each served ControlNet's name, class, family and bytes."""
        return [
            {
                "name": name,
                "class": type(net).__name__,
                "family": self.family.name,
                "bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
            }
            for name, net in self.loaded.items()
            if name not in self.uses.leaving
        ]

    def check(self, controls: Sequence[Control]) -> None:
        """Raise InvalidRequest naming `control` where a request's controls cannot run here."""
        if len(controls) > MAX_CONTROLS:
            raise InvalidRequest("control", f"at most {MAX_CONTROLS} controls a request; got {len(controls)}")
        for c in controls:
            if c.model not in self.loaded:
                unknown_net = unknown("ControlNet", c.model, self.loaded, "this server serves none")
                raise InvalidRequest("control", unknown_net)
            if not 0.0 <= c.scale <= MAX_SCALE:
                raise InvalidRequest("control", f"scale must be from 0 to {MAX_SCALE}; got {c.scale}")
            if not 0.0 <= c.start < c.end <= 1.0:
                raise InvalidRequest("control", f"start and end: 0 ≤ start < end ≤ 1; got {c.start}, {c.end}")

    def rows(self, request: Any, rows: int, vae: nn.Module, generator: Any) -> tuple[RowControl, ...]:
        """Each of a request's controls, its image prepared as the family's ControlNet pipeline
        prepares it (at the request's size; FLUX.1's encoded by `vae`, a sample drawn from the
        request's `generator`: before its noise, as FluxControlNetPipeline draws them), on its `rows`."""
        prepared = []
        for c in request.control:
            net = self.loaded[c.model]
            image = self.family.control_image(net, c.image, request.width, request.height, vae, generator)
            image = image.to(self.device, self.dtype).expand(rows, *image.shape[1:]).contiguous()
            prepared.append(RowControl(c, image))
        return tuple(prepared)

    def residuals(self, states: Sequence[Any], inputs: DenoiserInputs) -> dict[str, Any]:
        """The residuals of a call of `states`' rows (`inputs`): each ControlNet asked for at this
        step once, on its rows; {} where none acts."""
        asked: dict[str, list[tuple[slice, range, RowControl]]] = {}  # each request's rows, those run
        start = 0
        for state in states:
            span = slice(start, start + state.rows)
            start = span.stop
            for row in state.controls:
                if row.control.on_at(state.index, state.steps):
                    asked.setdefault(row.control.model, []).append((span, self._runs_on(span), row))
        if not asked:
            return {}
        totals: dict[str, list[torch.Tensor]] = {}
        tupled: dict[str, bool] = {}  # a keyword taking a tuple of residuals (else one tensor)
        device = inputs.sample.device
        for name, rows in asked.items():
            index = host_values([r for _, run, _ in rows for r in run], device)
            into = torch.cat([torch.arange(s.start, s.stop, device=device) for s, _, _ in rows])
            source = host_values(_sources(rows), device)  # each landing row's row in the call
            here = self.device  # the ControlNets' (the first replica's); a lane's call may be elsewhere
            image = torch.cat([row.image[: len(run)] for _, run, row in rows])
            made = self.family.control_residuals(self.loaded[name], _rows(inputs, index, here), image)
            scales = [row.control.scale for _, run, row in rows for _ in run]
            scale = host_values(scales, device, torch.float32)  # float32: scaled as the nets scale,
            for key, value in made.items():  # in float32 arithmetic, then rounded once
                if value is None:
                    continue
                tupled[key] = isinstance(value, tuple)
                parts = value if tupled[key] else (value,)
                if key not in totals:
                    totals[key] = [inputs.sample.new_zeros((start, *p.shape[1:])) for p in parts]
                for total, part in zip(totals[key], parts, strict=True):
                    scaled = part.to(total.device) * scale.view(-1, *[1] * (part.dim() - 1))
                    total.index_add_(0, into, scaled.index_select(0, source).to(total.dtype))
        return {key: tuple(parts) if tupled[key] else parts[0] for key, parts in totals.items()}

    def _runs_on(self, span: slice) -> range:
        """The rows of a request's `span` its ControlNets run on: all, or the positive row of a
        guided pair where the family's pipeline reuses its residuals for the negative row."""
        if self.family.control_on_positive and span.stop - span.start == 2:
            return range(span.stop - 1, span.stop)
        return range(span.start, span.stop)


def _sources(rows: Sequence[tuple[slice, range, RowControl]]) -> list[int]:
    """For each row residuals land on (the spans' rows, in order), the row of the net's call that
    made them: its own, or the one row run for its pair (`ControlNets._runs_on`)."""
    sources, at = [], 0
    for span, run, _ in rows:
        width = span.stop - span.start
        sources += [at + (i if len(run) == width else 0) for i in range(width)]
        at += len(run)
    return sources


def controlnet_folder(folder: Path, shown: str | None = None) -> Path:
    """`folder` if it holds a ControlNet in diffusers' format with safetensors weights, else a
    ValueError saying what is missing (checked before any weight loads), naming the folder as
    `shown` (a runtime load's: the client's words, not a server path) or by its path."""
    named, config = shown or str(folder), folder / "config.json"
    if not folder.is_dir() or not config.is_file():
        raise ValueError(f"{named} is not a ControlNet folder (diffusers' format: config.json and weights)")
    try:
        kind = json.loads(config.read_text()).get("_class_name")
    except ValueError:
        raise ValueError(f"{named}'s config.json is not JSON") from None
    if not isinstance(kind, str) or not isinstance(getattr(diffusers, kind, None), type):
        raise ValueError(f"{named}'s config.json names no diffusers class (_class_name: {kind!r})")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{named} holds no .safetensors weights (ControlNets load from safetensors only)")
    return folder


def runtime_controlnet(name: str, folder: str, root: Path) -> Path:
    """`folder` inside `root` (--controlnet-dir) as a runtime ControlNet's: a client names a folder
    of the operator's, never a server path. InvalidRequest names the field that is wrong."""
    path = runtime_path(name, folder, root, "folder", "--controlnet-dir")
    try:
        return controlnet_folder(path, repr(folder))
    except ValueError as error:
        raise InvalidRequest("folder", str(error)) from None


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, list | tuple) else value


def _rows(inputs: DenoiserInputs, index: torch.Tensor, device: torch.device) -> DenoiserInputs:
    """The rows `index` of a call's inputs, on `device`."""

    def take(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.index_select(0, index).to(device)
        if isinstance(value, Mapping):
            return {k: take(v) for k, v in value.items()}
        return value

    return DenoiserInputs(*(take(v) for v in vars(inputs).values()))
