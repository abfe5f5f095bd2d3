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
code, its input signature, the torch version and the device kind; inductor's compiled kernels
live beside it (`TORCHINDUCTOR_CACHE_DIR`). The next start loads both and traces nothing: on
the 2-core CPU image the built-in model's 2-row bucket loads in ~2 s where tracing and
compiling it takes ~60 s. A precompiled file that cannot be read or no longer fits is
ignored with a warning and compiled again.

Frozen graphs (CPU, `full`). On a CPU, inductor's freezing (weights folded into the graph as
constants and prepacked for oneDNN) is where a compiled UNet gains: the SD-1.5 UNet's bf16
2-row call took 0.51 s frozen against 0.77 s eager on a 2-core AVX-512 host, where unfrozen
graphs (weights as inputs) were no faster than eager. A frozen graph closes over its model
instead of taking it as an argument, is compiled just in time (`aot_compile` cannot freeze in
torch 2.13) and again at every start, in the background (inductor cannot cache a graph holding
oneDNN's prepacked weights; its kernels' C++ builds are cached: the built-in model's 4 frozen
buckets took 232 s cold and 45 s the next start, where its unfrozen graphs loaded in 3 s), and
holds its own prepacked copy of the weights: the buckets freeze, smallest first (a lone image's
first), while their copies fit `freeze_budget`; the rest compile unfrozen. Adapters' hooks and
runtime attach/detach never touch a frozen graph (rows with adapters run eagerly, on the
model's own weights); weights changed in place would (nothing here does that).

The loaded functions run without dynamo's guards: this module checks the exact signature (the
shape, dtype and device of every input tensor, every other input's value) before it calls one,
which is the check the guards would make. Rows with adapters (hooks on layers, which a compiled
graph never calls) run eagerly: the call plan says so.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
    tensor_bytes,
    walk_plain,
)
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
    """What a compiled graph is specialised to: every tensor's shape, dtype and device, every other
    input's value, and the nesting. `resized=(rows, bucket)`: as if `pad_rows` had padded `args`
    to `bucket` rows (nothing is copied)."""
    leaves, spec = tree_flatten(args)

    def describe(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape)
            if resized is not None and shape and shape[0] == resized[0]:
                shape = (resized[1], *shape[1:])
            return (shape, str(leaf.dtype), str(leaf.device))
        return repr(leaf)

    return (str(spec), *(describe(leaf) for leaf in leaves))


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


def frozen_denoiser(spec: Any, model: nn.Module, name: str) -> Callable[..., torch.Tensor]:
    """`run_denoiser` holding `spec` and `model` (freezing folds what a function holds, never its
    arguments), under a code object of its own named `name`: dynamo keeps graphs per code object,
    so one bucket's or model's graph is never another's, and `GraphStore.release` frees it alone."""

    def run(sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, conditioning: Any):
        return walk_plain(spec, model, DenoiserInputs(sample, timestep, context, conditioning))

    run.__code__ = run.__code__.replace(co_name=name, co_qualname=name)
    return run


FREEZE_FLOOR = 512 * 2**20  # a small model's frozen buckets all fit
FROZEN_COPIES = 2  # a large one's: the weights' bytes twice over (a lone image at two sizes)


def freeze_budget(model: nn.Module, devices: Sequence[str], mode: CompileMode) -> int:
    """Bytes of frozen copies of `model`'s weights its graphs may hold: 0 where nothing freezes
    (a GPU: its graphs gain without; blocks: their graphs take the module as an argument)."""
    if mode != CompileMode.FULL or any(d != "cpu" for d in devices):
        return 0
    return max(FREEZE_FLOOR, FROZEN_COPIES * tensor_bytes(model))


def decodes_in_tiles(vae: nn.Module, shape: Sequence[int]) -> bool:
    """Whether `vae.decode` tiles latents of `shape`: diffusers' rule once `enable_tiling()`."""
    return bool(getattr(vae, "use_tiling", False)) and max(shape[-2:]) > vae.tile_latent_min_size


def pad_rows(obj: Any, rows: int, bucket: int) -> Any:
    """Every tensor whose first dimension is `rows`, padded to `bucket` rows by repeating its last."""
    if bucket == rows:
        return obj

    def pad(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows:
            return torch.cat([leaf, leaf[-1:].expand(bucket - rows, *leaf.shape[1:])])
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
        self._frozen: dict[tuple, str] = {}  # full: the frozen ones' store keys
        self._weights = tensor_bytes(model)
        self._freeze_left = freeze_budget(model, devices, mode)  # bytes more frozen copies may take
        self._blocks: dict[str, dict[tuple, Any]] = {}  # blocks: name → padded flow's signature → graph
        self._count = threading.Lock()
        self._quiet = threading.local()  # `uncounted`

    # Warming: compile or load a bucket from a real call's inputs.

    def warm_whole(self, padded: DenoiserInputs, rows: int) -> list[tuple[str, tuple]]:
        """The whole call's graph for `padded` (`rows` rows); the (block, key) it added."""
        flat = _flat(padded)
        key = signature(flat)
        added = [] if key in self._whole else [("", key)]
        if added:
            what = {"graph": "denoiser", "class": type(self.model).__name__, "config": self.model.config}
            if self._freeze_left >= self._weights and (frozen := self._freeze(what, key, flat)):
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

    def _freeze(self, what: dict[str, Any], key: tuple, flat: tuple) -> Callable[..., torch.Tensor] | None:
        """A frozen graph for `flat`'s bucket, or None (and nothing freezes from now on) where
        inductor cannot freeze this model (its weights quantized, say): it compiles unfrozen."""
        # its weights are its own: one model's frozen graph is never another's (experts)
        stored = self.store.key({**what, "inputs": key, "frozen": next(self.model.parameters()).data_ptr()})
        try:
            run = frozen_denoiser(self.spec, self.model, f"frozen_{stored}")
            graph = self.store.frozen(stored, run, flat)
        except Exception as err:
            log.warning("cannot freeze %s (%s): compiling it unfrozen", type(self.model).__name__, err)
            self.store.release(stored)
            self._freeze_left = 0
            return None
        self._frozen[key] = stored
        self._freeze_left -= self._weights
        self.stats.frozen += 1
        return graph

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
            if (stored := self._frozen.pop(key, None)) is not None:  # its copy of the weights, freed
                self.store.release(stored)
                self._freeze_left += self._weights
                self.stats.frozen -= 1

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Calls on this thread go uncounted (a measurement's, not the service's)."""
        self._quiet.on = True
        try:
            yield
        finally:
            self._quiet.on = False

    # Serving.

    def whole(self, inputs: DenoiserInputs) -> torch.Tensor | None:
        """The call through its bucket's whole graph (counted), or None (the walker runs it)."""
        if self.mode != CompileMode.FULL:
            return None
        flat = _flat(inputs)
        rows = flat[0].shape[0]
        found = find_bucket(flat, rows, self._rows, self._whole)
        if found is None:
            return None
        bucket, graph = found
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
        if getattr(self._quiet, "on", False):
            return
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
        self._graphs: dict[tuple, Any] = {}
        self._counts: list[int] = []

    def warm(self, latents: torch.Tensor) -> tuple | None:
        """The graph for `latents`' shape; its key if added here (`drop` takes it)."""
        key = signature(latents)
        if key in self._graphs or decodes_in_tiles(self.vae, latents.shape):
            return None
        what = {"graph": "decoder", "class": type(self.vae).__name__, "config": self.vae.config, "in": key}
        graph = self.store.get(self.store.key(what), run_decoder, (self.vae, latents), {"vae": self.vae})
        self._graphs[key] = graph
        self._counts = sorted({*self._counts, latents.shape[0]})
        self.store.stats.graphs_ready += 1
        return key

    def drop(self, key: tuple) -> None:
        """Stop using a graph measured slower than eager: its shape decodes eagerly."""
        self._graphs.pop(key, None)

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        count = latents.shape[0]
        found = find_bucket(latents, count, self._counts, self._graphs)
        if found is None:
            return run_decoder(self.vae, latents)
        bucket, graph = found
        return graph(self.vae, pad_rows(latents, count, bucket))[:count]
