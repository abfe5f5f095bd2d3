"""A frozen graph's attention by the kernel measured faster for each of its shapes: PyTorch's flash
kernel for CPUs, or the scores by oneDNN's batched GEMM and a softmax, a chunk of queries at a time.

Which wins depends on the shape and the CPU (docs/serving.md has figures, with their host): the
chunked GEMMs on few wide heads, such as a VAE's, the flash kernel elsewhere. So each shape is
timed both ways on this host before the graph is traced (`choose_kernels`), and the graph routes
the shapes that measured faster chunked (`routed`).
Only plain calls are routed: no mask, no dropout, not causal, the default scale."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

log = logging.getLogger("diffshard")

CHUNK = 256  # queries a chunk: 8 heads × 256 × 4096 bf16 scores are 16 MiB, not 256 MiB at once
ROUNDS = 3  # timed calls a kernel, after one to warm it


class Shape(NamedTuple):
    """One attention call's shape: [batch, heads, tokens, dim] queries, keys and values."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: torch.dtype


def plain(args: tuple, kwargs: dict[str, Any], device: str | None = "cpu") -> Shape | None:
    """The shape of an SDPA call the chunked kernel computes alike, or None; only of tensors on
    a `device` of that type (None: any): the chunked kernel is for CPUs, the backends' timing
    (`sdpa_backend.py`) reads shapes on the meta device."""
    q, k, v, *rest = args  # positional q, k, v: a call by keywords raises (see `by_position`)
    if rest or kwargs.get("attn_mask") is not None or kwargs.get("scale") is not None:
        return None
    if kwargs.get("dropout_p") or kwargs.get("is_causal") or kwargs.get("enable_gqa"):
        return None
    if q.dim() != 4 or q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        return None
    if device is not None and q.device.type != device:
        return None
    return Shape(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype)


def by_position(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """An SDPA call's query, key and value as positional arguments, wherever they were given
    (diffusers' `dispatch_attention_fn` names them). Only the backends' timing reads calls so:
    frozen CPU graphs route positional calls alone, and a keyword call fails their freeze (an
    unfrozen graph then), as it always has."""
    names = ("query", "key", "value")
    if len(args) >= 3 or not all(n in kwargs for n in names[len(args) :]):
        return args, kwargs
    rest = {key: value for key, value in kwargs.items() if key not in names}
    return (*args, *(kwargs[n] for n in names[len(args) :])), rest


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d) v, as `F.scaled_dot_product_attention` without mask or dropout."""
    batch, heads, tokens, dim = q.shape
    q = q.reshape(batch * heads, tokens, dim)
    keys = k.reshape(batch * heads, -1, dim).transpose(1, 2)
    values = v.reshape(batch * heads, -1, v.shape[-1])
    unused = torch.empty(1, 1, 1, dtype=q.dtype, device=q.device)  # baddbmm's input, times beta=0
    out = []
    for start in range(0, tokens, CHUNK):
        scores = torch.baddbmm(unused, q[:, start : start + CHUNK], keys, beta=0, alpha=dim**-0.5)
        out.append(torch.bmm(scores.softmax(-1), values))
    return torch.cat(out, 1).reshape(batch, heads, tokens, -1)


class Recording(TorchFunctionMode):
    """Counts the plain attention calls under it by shape, those on a `device` of that type (None:
    any), and with `keywords` those naming their query, key and value too; each runs as usual."""

    def __init__(self, device: str | None = "cpu", keywords: bool = False) -> None:
        super().__init__()
        self.device, self.keywords = device, keywords
        self.calls: Counter[Shape] = Counter()

    @property
    def shapes(self) -> set[Shape]:
        return set(self.calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            read = by_position(args, kwargs) if self.keywords else (args, kwargs)
            if (shape := plain(*read, self.device)) is not None:
                self.calls[shape] += 1
        return func(*args, **kwargs)


class Routed(TorchFunctionMode):
    """Plain attention calls of the `faster` shapes run chunked; the others as they are."""

    def __init__(self, faster: frozenset[Shape]) -> None:
        super().__init__()
        self.faster = faster  # (traced into a graph: a set, not a dict of kernel names)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and plain(args, kwargs) in self.faster:
            return chunked(*args[:3])
        return func(*args, **kwargs)


def seconds(kernel: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...]) -> float:
    """The median of `ROUNDS` timed calls, after one to warm it."""
    kernel(*tensors)
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        kernel(*tensors)
        times.append(time.perf_counter() - started)
    return sorted(times)[ROUNDS // 2]


def measured(shapes: Iterable[Shape]) -> dict[Shape, str]:
    """Each shape's faster kernel here, now: "flash" or "chunked"."""
    kernels = {}
    generator = torch.Generator().manual_seed(0)
    for shape in shapes:
        q, k, v = (torch.randn(s, generator=generator).to(shape.dtype) for s in shape[:3])
        flash, mine = seconds(F.scaled_dot_product_attention, (q, k, v)), seconds(chunked, (q, k, v))
        kernels[shape] = "chunked" if mine < flash else "flash"
        log.info(
            "attention of %s queries, %s keys (%s): flash %.1f ms, chunked %.1f ms",
            shape.query,
            shape.key,
            shape.dtype,
            flash * 1e3,
            mine * 1e3,
        )
    return kernels


def choose_kernels(fn: Callable[..., Any], example: tuple) -> dict[Shape, str]:
    """The faster kernel of each attention shape of `fn(*example)` (one call, eagerly)."""
    recording = Recording()
    with torch.inference_mode(), recording:
        fn(*example)
    return measured(sorted(recording.shapes, key=str))


def routed(fn: Callable[..., Any], kernels: dict[Shape, str]) -> Callable[..., Any]:
    """`fn` with its attention run chunked where `kernels` says (traced into its graph)."""
    faster = frozenset(shape for shape, kernel in kernels.items() if kernel == "chunked")

    def run(*args: Any) -> Any:
        with Routed(faster):
            return fn(*args)

    return run
