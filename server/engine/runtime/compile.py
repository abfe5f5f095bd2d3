"""Compiled denoisers: `torch.compile` per shape bucket, precompiled once and loaded warm from disk.

A shape bucket is a latent size and a row count. A call's rows are padded up to the smallest
bucket that holds them (rows are independent in every denoiser we serve: padding changes no
row's result), so a handful of compiled shapes serve every batch the step loop makes; a call
that fits no bucket runs eagerly and is counted, never fails, and never compiles on the
serving path.

Two units (`--compile`):
- `full`: the whole denoiser, one graph per bucket (one stage only, no adapters, no step
  caching: those need the block walker between blocks).
- `blocks` (regional compilation): every block's call (`BlockCall`), one graph per block kind
  and input shape, so blocks that repeat (a DiT's) share one. The walker calls them between
  its stage transfers, so sharding and compilation compose, and a step-cached call's deep
  blocks find the bucket of their refreshing rows.

Warm starts. Each graph is compiled ahead of time (`torch.compile(...).aot_compile`,
fullgraph) and saved as a precompiled function under the cache directory, keyed by the graph's
code, its input signature, the versions of torch, diffusers and the code it traces
(`graphs.traced_code`) and the device kind; inductor's compiled kernels live beside it
(`TORCHINDUCTOR_CACHE_DIR`). The next start loads both and traces nothing: on
the 2-core CPU image the built-in model's 2-row bucket loads in ~2 s where tracing and
compiling it takes ~60 s. A precompiled file that cannot be read or no longer fits is
ignored with a warning and compiled again.

Frozen graphs (`frozen.py`). On a CPU, a whole call's graph and the decoder's fold their
weights in (inductor's freezing), within a budget of copies, kept as AOTInductor libraries that
the next start loads (`packages.py`; frozen just in time at every start on the jit route).

The loaded functions run without dynamo's guards: this module checks the exact signature (the
shape, dtype and device of every input tensor, every other input's value) before it calls one,
which is the check the guards would make. Rows with adapters (hooks on layers, which a compiled
graph never calls) run eagerly: the call plan says so.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from server.engine.denoisers.blocks import (
    BlockCall,
    DenoiserInputs,
    Flow,
    map_rows,
    walk_plain,
)
from server.engine.runtime.frozen import Freezer
from server.engine.runtime.graphs import GraphStore

log = logging.getLogger("diffshard")


class CompileMode(enum.StrEnum):
    OFF = "off"
    BLOCKS = "blocks"
    FULL = "full"
    AUTO = "auto"  # full or blocks as the plan allows, each bucket kept where measured faster


def row_buckets(max_rows: int, smallest: int = 1) -> tuple[int, ...]:
    """`smallest`, doubled while below `max_rows`, then `max_rows`: a call pads by less than 2x."""
    rows, out = smallest, []
    while rows < max_rows:
        out.append(rows)
        rows *= 2
    return (*out, max_rows)


def signature(args: Any, resized: tuple[int, int] | None = None) -> tuple:
    """What a compiled graph is specialised to: every tensor's shape, strides, dtype and device,
    every other input's value, and the nesting. The graphs have no guards and assume the strides
    they were traced with (a spec's transposed view, a prompt's columns cut from a wider buffer):
    a call whose strides differ runs eagerly instead. `resized=(rows, bucket)`: as if `pad_rows`
    had padded `args` to `bucket` rows (nothing is copied; a padded tensor is contiguous)."""
    leaves, spec = tree_flatten(args)

    def describe(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            shape, strides = tuple(leaf.shape), leaf.stride()
            if resized is not None and resized[0] != resized[1] and shape and shape[0] == resized[0]:
                shape = (resized[1], *shape[1:])
                strides = _contiguous_strides(shape)
            return (shape, strides, str(leaf.dtype), str(leaf.device))
        return repr(leaf)

    return (str(spec), *(describe(leaf) for leaf in leaves))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides for `shape` (counted: `signature` runs at every block call)."""
    strides, step = [], 1
    for side in reversed(shape):
        strides.append(step)
        step *= max(side, 1)
    return tuple(reversed(strides))


def find_bucket(args: Any, rows: int, buckets: list[int], graphs: dict[tuple, Any]) -> tuple[int, Any] | None:
    """The smallest bucket of at least `rows` rows with a graph for `args` padded to it, and that
    graph; None if there is none. Only the found bucket's inputs are then padded."""
    for bucket in buckets:
        if bucket >= rows and (graph := graphs.get(signature(args, (rows, bucket)))) is not None:
            return bucket, graph
    return None


# The functions compiled: module level, so a precompiled file can name them.
def run_denoiser(spec: Any, model: nn.Module, *inputs: Any) -> torch.Tensor:
    return walk_plain(spec, model, DenoiserInputs(*inputs))


def run_decoder(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    return vae.decode(latents, return_dict=False)[0]


def holding_denoiser(spec: Any, model: nn.Module) -> Callable[[], Callable[..., torch.Tensor]]:
    """`run_denoiser` holding `spec` and `model` (freezing folds what a function holds, never its
    arguments), for `Freezer.freeze`."""

    def holding() -> Callable[..., torch.Tensor]:
        def run(sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, conditioning: Any):
            return walk_plain(spec, model, DenoiserInputs(sample, timestep, context, conditioning))

        return run

    return holding


def holding_decoder(vae: nn.Module) -> Callable[[], Callable[[torch.Tensor], torch.Tensor]]:
    """`run_decoder` holding `vae`, for `Freezer.freeze`."""

    def holding() -> Callable[[torch.Tensor], torch.Tensor]:
        def run(latents: torch.Tensor) -> torch.Tensor:
            return run_decoder(vae, latents)

        return run

    return holding


def decodes_in_tiles(vae: nn.Module, shape: Sequence[int]) -> bool:
    """Whether `vae.decode` tiles latents of `shape`: diffusers' rule once `enable_tiling()`."""
    return bool(getattr(vae, "use_tiling", False)) and max(shape[-2:]) > vae.tile_latent_min_size


def pad_rows(obj: Any, rows: int, bucket: int) -> Any:
    """Every tensor whose first dimension is `rows`, padded to `bucket` rows by repeating its last."""
    if bucket == rows:
        return obj

    def pad(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows:
            return torch.cat([leaf, leaf[-1:].expand(bucket - rows, *leaf.shape[1:])]).contiguous()
        return leaf

    return tree_map(pad, obj)


def _flat(inputs: DenoiserInputs) -> tuple:
    """A call's inputs as the graphs take them, a scalar timestep as one per row."""
    timestep, rows = inputs.timestep, inputs.sample.shape[0]
    if not isinstance(timestep, torch.Tensor) or timestep.dim() == 0:
        timestep = torch.full((rows,), float(timestep), device=inputs.sample.device)
    return inputs.sample, timestep, inputs.context, inputs.conditioning


class CompiledDenoiser:
    """A ModelShard's model compiled per bucket: the whole call (`full`) or each block (`blocks`)."""

    def __init__(
        self,
        model: nn.Module,
        spec: Any,
        calls: dict[str, BlockCall],
        mode: CompileMode,
        devices: Sequence[str],
        store: GraphStore,
    ) -> None:
        if mode == CompileMode.FULL and len(devices) > 1:
            raise ValueError("--compile full needs a plan of one stage; --compile blocks compiles a split")
        self.model, self.spec, self.calls, self.mode, self.store = model, spec, calls, mode, store
        self.stats = store.stats
        self._rows: list[int] = []  # the buckets' row counts, ascending
        self._whole: dict[tuple, Callable[..., torch.Tensor]] = {}  # full: padded inputs' signature → graph
        self._freezer = Freezer(model, devices, mode == CompileMode.FULL, store)  # full, on a CPU
        self._blocks: dict[str, dict[tuple, Any]] = {}  # blocks: name → padded flow's signature → graph
        self._count = threading.Lock()

    # Warming: compile or load a bucket from a real call's inputs.

    def warm_whole(self, padded: DenoiserInputs, rows: int) -> list[tuple[str, tuple]]:
        """The whole call's graph for `padded` (`rows` rows); the (block, key) it added."""
        flat = _flat(padded)
        key = signature(flat)
        added = [] if key in self._whole else [("", key)]
        if added:
            what = {"graph": "denoiser", "class": type(self.model).__name__, "config": self.model.config}
            holding = holding_denoiser(self.spec, self.model)
            if frozen := self._freezer.freeze({**what, "inputs": key}, key, holding, flat):
                self._whole[key] = frozen
            else:
                graph = self.store.get(
                    self.store.key({**what, "inputs": key}),
                    run_denoiser,
                    (self.spec, self.model, *flat),
                    {"model": self.model, "spec": self.spec},
                )
                self._whole[key] = partial(graph, self.spec, self.model)
            self.stats.graphs_ready += 1
        self._rows = sorted({*self._rows, rows})
        return added

    def warm_blocks(self, captured: dict[str, Flow], rows: int) -> list[tuple[str, tuple]]:
        """Each block's graph for the flow it was called with (`captured`, `rows` rows); the
        (block, key) pairs it added."""
        added = []
        for name, flow in captured.items():
            call, key = self.calls[name], _flow_signature(flow)
            graphs = self._blocks.setdefault(name, {})
            if key not in graphs:
                added.append((name, key))
                owner = call.owner
                what = {"graph": "block", "fn": call.fn.__qualname__, "structure": repr(owner), "inputs": key}
                graphs[key] = self.store.get(
                    self.store.key(what), call.fn, (owner, flow.rows, flow.shared), {"owner": owner}
                )
            self.stats.graphs_ready += 1
        self._rows = sorted({*self._rows, rows})
        return added

    def drop(self, added: list[tuple[str, tuple]]) -> None:
        """Stop using graphs `warm_*` added (measured slower than eager): their calls run eagerly."""
        for name, key in added:
            (self._blocks.get(name, {}) if name else self._whole).pop(key, None)
            if not name:
                self._freezer.drop(key)

    # Serving.

    def whole(self, inputs: DenoiserInputs, counted: bool = True) -> torch.Tensor | None:
        """The call through its bucket's whole graph (`counted`: in the service's call counts), or
        None (the walker runs it)."""
        if self.mode != CompileMode.FULL:
            return None
        flat = _flat(inputs)
        rows = flat[0].shape[0]
        found = find_bucket(flat, rows, self._rows, self._whole)
        if found is None:
            return None
        bucket, graph = found
        if counted:
            self.count({"padded" if bucket > rows else "compiled"})
        with torch.inference_mode():
            return graph(*pad_rows(flat, rows, bucket))[:rows]

    def block(self, name: str, call: BlockCall, flow: Flow) -> tuple[dict[str, Any] | None, str]:
        """Block `name`'s new rows through its bucket's graph, or None; and the path it took."""
        graphs = self._blocks.get(name)
        rows = _rows_in(flow)
        if graphs is None or rows is None:
            return None, "eager"
        for bucket in self._rows:
            if bucket >= rows and (graph := graphs.get(_flow_signature(flow, (rows, bucket)))) is not None:
                padded = pad_rows(flow.rows, rows, bucket)
                out = graph(call.owner, padded, flow.shared)
                if bucket == rows:
                    return out, "compiled"
                return map_rows(out, lambda t: t[:rows]), "padded"
        return None, "eager"

    def count(self, paths: set[str]) -> None:
        """One call's path: eager if any block ran eagerly, else padded if any was padded."""
        path = next((p for p in ("eager", "padded") if p in paths), "compiled") if paths else "eager"
        with self._count:
            self.stats.calls[path] += 1


def _rows_in(flow: Flow) -> int | None:
    leaves, _ = tree_flatten(flow.rows)
    return next((leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()), None)


def _flow_signature(flow: Flow, resized: tuple[int, int] | None = None) -> tuple:
    return (signature(flow.rows, resized), signature(flow.shared))


class CompiledDecoder:
    """A VAE's decode compiled per latent shape (one image per bucket row count).

    Latents the VAE decodes in tiles (`enable_tiling()`, larger than its tile) are never compiled:
    they run diffusers' `tiled_decode` eagerly. Traced, its loop would unroll every tile and every
    blended row into one graph per size; compiling the tile alone would mean copying the loop."""

    def __init__(self, vae: nn.Module, store: GraphStore) -> None:
        self.vae, self.store = vae, store
        self._graphs: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._counts: list[int] = []
        device = str(next(vae.parameters()).device)
        self._freezer = Freezer(vae, [device], True, store)  # on a CPU: 1 image first, then 2 …
        self.eager_only: str | None = None  # why this VAE's decode cannot compile, once found

    def warm(self, latents: torch.Tensor) -> tuple | None:
        """The graph for `latents`' shape; its key if added here (`drop` takes it). A decode that
        cannot be traced (HunyuanVideo-1.5's VAE branches on its data) stays eager, and the
        denoiser's graphs serve regardless."""
        key = signature(latents)
        if key in self._graphs or self.eager_only or decodes_in_tiles(self.vae, latents.shape):
            return None
        what = {"graph": "decoder", "class": type(self.vae).__name__, "config": self.vae.config, "in": key}
        graph = self._freezer.freeze(what, key, holding_decoder(self.vae), (latents,))
        if graph is None:
            try:
                stored = self.store.get(
                    self.store.key(what), run_decoder, (self.vae, latents), {"vae": self.vae}
                )
            except Exception as err:  # dynamo's refusals have no common class
                self.eager_only = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                log.warning(
                    "cannot compile %s's decode (%s): it decodes eagerly",
                    type(self.vae).__name__,
                    self.eager_only,
                )
                return None
            graph = partial(stored, self.vae)
        self._graphs[key] = graph
        self._counts = sorted({*self._counts, latents.shape[0]})
        self.store.stats.graphs_ready += 1
        return key

    def drop(self, key: tuple) -> None:
        """Stop using a graph measured slower than eager: its shape decodes eagerly."""
        self._graphs.pop(key, None)
        self._freezer.drop(key)

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        count = latents.shape[0]
        found = find_bucket(latents, count, self._counts, self._graphs)
        if found is None:
            return run_decoder(self.vae, latents)
        bucket, graph = found
        return graph(pad_rows(latents, count, bucket))[:count]
