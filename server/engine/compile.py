"""Compiled denoisers: `torch.compile` per shape bucket, precompiled once and loaded warm from disk.

A shape bucket is a latent size and a row count. A call's rows are padded up to the smallest
bucket that holds them (rows are independent in every denoiser we serve: padding changes no
row's result), so a handful of compiled shapes serve every batch the step loop makes; a call
that fits no bucket runs eagerly and is counted, never fails, and never compiles on the
serving path.

Two units (`--compile`):
- `full`: the whole denoiser, one graph per bucket (one stage only: a split's stage hooks
  sit between blocks).
- `blocks` (regional compilation): every module of every engine block, one graph per module
  kind and input shape, so blocks that repeat (a DiT's) share one, and a ModelShard's stage
  hooks, which run between blocks, stay eager: sharding and compilation compose.

Warm starts. Each graph is compiled ahead of time (`torch.compile(...).aot_compile`,
fullgraph) and saved as a precompiled function under the cache directory, keyed by the graph's
code, its input signature, the torch version and the device kind; inductor's compiled kernels
live beside it (`TORCHINDUCTOR_CACHE_DIR`). The next start loads both and traces nothing: on
the 2-core CPU image the built-in model's 2-row bucket loads in ~2 s where tracing and
compiling it takes ~60 s. A precompiled file that cannot be read or no longer fits is
ignored with a warning and compiled again.

The loaded functions run without dynamo's guards: this module checks the exact signature (the
shape, dtype and device of every input tensor, every other input's value) before it calls one,
which is the check the guards would make. Adapters' rows (LoRA hooks on layers, which a
compiled graph never calls) run eagerly: `eager_calls()`.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from server.engine.blocks import DenoiserInputs, Layout
from server.engine.graphs import GraphStore

_local = threading.local()  # .eager: this thread's calls run eagerly; .bucket: the bucket of a call in flight


class CompileMode(enum.StrEnum):
    OFF = "off"
    BLOCKS = "blocks"
    FULL = "full"


@contextlib.contextmanager
def eager_calls() -> Iterator[None]:
    """Within: denoiser calls on this thread run eagerly (rows with adapters: hooks to call)."""
    before = getattr(_local, "eager", False)
    _local.eager = True
    try:
        yield
    finally:
        _local.eager = before


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
    return spec.forward(model, DenoiserInputs(*inputs))


def run_module(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    return module.forward(*args, **kwargs)  # its own: dispatchers are detached while compiling


def run_decoder(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    return vae.decode(latents, return_dict=False)[0]


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
    """A ModelShard's model compiled per bucket; `run` pads a call to a bucket or returns None."""

    def __init__(
        self, model: nn.Module, spec: Any, layout: Layout, mode: CompileMode, stages: int, store: GraphStore
    ) -> None:
        if mode == CompileMode.FULL and stages > 1:
            raise ValueError("--compile full needs a plan of one stage; --compile blocks compiles a split")
        self.model, self.spec, self.layout, self.mode, self.store = model, spec, layout, mode, store
        self.stats = store.stats
        self._buckets: dict[tuple, Any] = {}  # padded inputs' signature → graph (full) or bucket index
        self._rows: list[int] = []  # the buckets' row counts, ascending
        self._count = threading.Lock()
        self._modules: dict[str, dict[int, tuple[tuple, Any]]] = {}  # path → bucket → (signature, graph)

    # Warming: compile or load a bucket from a real call's inputs.

    def warm(self, inputs: DenoiserInputs, rows: int) -> None:
        """Make ready the bucket of `inputs` padded to `rows` rows."""
        flat = _flat(inputs)
        padded = pad_rows(flat, flat[0].shape[0], rows)
        key = signature(padded)
        if key in self._buckets:
            return
        if self.mode == CompileMode.FULL:
            what = {"graph": "denoiser", "class": type(self.model).__name__, "config": self.model.config}
            graph = self.store.get(
                self.store.key({**what, "inputs": key}),
                run_denoiser,
                (self.spec, self.model, *padded),
                {"model": self.model, "spec": self.spec},
            )
            self.stats.graphs_ready += 1
        else:
            graph = len(self._buckets)
            self._warm_modules(padded, graph)
        self._buckets[key] = graph
        self._rows = sorted({*self._rows, rows})

    def _warm_modules(self, padded: tuple, bucket: int) -> None:
        self._detach()  # traced and captured as they are: no dispatcher (and its graphs) inside
        try:
            for path, (args, kwargs) in self._captured(padded).items():
                module = self.model.get_submodule(path)
                inputs = signature((args, kwargs))
                what = {"graph": "module", "class": type(module).__qualname__, "structure": repr(module)}
                graph = self.store.get(
                    self.store.key({**what, "inputs": inputs}),
                    run_module,
                    (module, args, kwargs),
                    {"module": module},
                )
                self._modules.setdefault(path, {})[bucket] = (inputs, graph)
                self.stats.graphs_ready += 1
        finally:
            self._attach()

    def _captured(self, padded: tuple) -> dict[str, tuple[tuple, dict]]:
        """The arguments each block's modules are called with in an eager forward of `padded`."""
        captured: dict[str, tuple[tuple, dict]] = {}
        hooks = []
        for path in (path for block in self.layout.blocks for path in block.modules):

            def capture(_m: nn.Module, args: tuple, kwargs: dict, path: str = path) -> None:
                captured.setdefault(path, (args, kwargs))

            hooks.append(self.model.get_submodule(path).register_forward_pre_hook(capture, with_kwargs=True))
        try:
            with torch.inference_mode():
                self.spec.forward(self.model, DenoiserInputs(*padded))
        finally:
            for hook in hooks:
                hook.remove()
        return captured

    def _attach(self) -> None:
        """Each compiled module's forward: its bucket's graph while a compiled call is in flight
        (and the module is called as the bucket calls it), else its own."""
        for path, graphs in self._modules.items():
            module = self.model.get_submodule(path)
            original = type(module).forward.__get__(module)

            def forward(*args: Any, module=module, graphs=graphs, original=original, **kwargs: Any) -> Any:
                bucket = getattr(_local, "bucket", None)
                if bucket is not None and bucket in graphs:
                    expected, graph = graphs[bucket]
                    if signature((args, kwargs)) == expected:
                        return graph(module, args, kwargs)
                return original(*args, **kwargs)

            module.forward = forward

    def _detach(self) -> None:
        for path in self._modules:
            self.model.get_submodule(path).__dict__.pop("forward", None)

    # Serving.

    def run(self, inputs: DenoiserInputs) -> torch.Tensor | None:
        """The denoiser's output through a bucket's graph, or None (the caller runs it eagerly)."""
        path, out = "eager", None
        if not getattr(_local, "eager", False):
            flat = _flat(inputs)
            rows = flat[0].shape[0]
            found = find_bucket(flat, rows, self._rows, self._buckets)
            if found is not None:
                bucket, graph = found
                path = "padded" if bucket > rows else "compiled"
                out = self._call(graph, pad_rows(flat, rows, bucket))[:rows]
        with self._count:
            self.stats.calls[path] += 1
        return out

    def _call(self, graph: Any, padded: tuple) -> torch.Tensor:
        with torch.inference_mode():
            if self.mode == CompileMode.FULL:
                return graph(self.spec, self.model, *padded)
            _local.bucket = graph
            try:
                return self.spec.forward(self.model, DenoiserInputs(*padded))
            finally:
                _local.bucket = None

    def remove(self) -> None:
        """Every module's own forward back."""
        self._detach()
        self._modules.clear()


class CompiledDecoder:
    """A VAE's decode compiled per latent shape (one image per bucket row count)."""

    def __init__(self, vae: nn.Module, store: GraphStore) -> None:
        self.vae, self.store = vae, store
        self._graphs: dict[tuple, Any] = {}
        self._counts: list[int] = []

    def warm(self, latents: torch.Tensor) -> None:
        key = signature(latents)
        if key in self._graphs:
            return
        what = {"graph": "decoder", "class": type(self.vae).__name__, "config": self.vae.config, "in": key}
        graph = self.store.get(self.store.key(what), run_decoder, (self.vae, latents), {"vae": self.vae})
        self._graphs[key] = graph
        self._counts = sorted({*self._counts, latents.shape[0]})
        self.store.stats.graphs_ready += 1

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        count = latents.shape[0]
        found = find_bucket(latents, count, self._counts, self._graphs)
        if found is None:
            return run_decoder(self.vae, latents)
        bucket, graph = found
        return graph(self.vae, pad_rows(latents, count, bucket))[:count]
