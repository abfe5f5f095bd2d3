"""`--dtype auto` on a CPU: bfloat16 or float32, decided by timing the served denoiser's own
heaviest ops in both.

bfloat16 pays on a CPU only where the CPU runs it natively (avx512_bf16, or AMX's tiles):
elsewhere it is emulated, ~180× slower than float32, and is never timed. Where it is native, how
much it pays depends on the CPU (oneDNN's AMX kernels, or AVX-512's dot products) and on the
model's shapes (a 3×3 convolution of 320 channels, a projection of 3072, attention over 4096
tokens each gain differently; a small model's gain grows with a call's rows). So one forward of
the weightless denoiser at its native size and a full step's rows (`--max-batch`) is recorded
op by op (convolutions, matrix products, attention, with their shapes and strides), and
the ops carrying most of its FLOPs are each run in float32 and in bfloat16 in turn, round after
round, until each dtype's best time has been met twice (`settle`): what a busy neighbour adds
to a run fades from the bests. A lone calibration taken beside one was cached for good and chose
float32 on an AMX host.

The gain is the model's float32 seconds over its bfloat16 seconds, each op weighted by how often
one forward runs it; bfloat16 is served at `BF16_GAIN` or more. The decision is kept in the
cache directory under what decides it (the processor, its model number and bfloat16 flags, the
threads, torch, the model's ops), said in the log with its figures, and shown in /v1/stats.
Memory-bound ops (norms, activations) are not timed: bfloat16 halves their bytes, so the gain
counted is, if anything, low.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from server.engine.denoisers.blocks import walk_plain
from server.engine.denoisers.specs import spec_for
from server.engine.planning.cache import lookup, store
from server.engine.planning.flow import as_loaded

BF16_GAIN = 1.2  # bfloat16 must run the model's heaviest ops this much faster to be served
BF16_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")  # what runs bfloat16 natively, as /proc/cpuinfo names it
COVERAGE = 0.9  # the ops timed carry at least this share of the forward's FLOPs...
MOST_OPS = 8  # ...or are this many distinct ops, the heaviest
RUN_S = 0.05  # a timed run this long at most, where halving the op's rows can make it so...
MIN_ROWS = 512  # ...down to this many GEMM rows: fewer run below a kernel's steady speed
SAMPLE_S = 0.005  # a sample of a shorter op times as many runs as make it this long
MOST_ROUNDS = 12  # of an op's (float32, bfloat16) timings, at most
AGREE = 0.03  # two runs this close to an op's best say the best is its quiet time

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention


@dataclass(frozen=True)
class Rows:
    """Where a timed op's rows are: its argument `arg`, whose dimension `halved` is cut to shorten
    a run; its GEMM rows are that argument's elements over its `features` dimension's."""

    arg: int
    halved: int
    features: int


ROWS: dict[Any, Rows] = {
    aten.convolution: Rows(0, 2, 1),  # the input's height; a row per pixel
    aten.mm: Rows(0, 0, 1),
    aten.addmm: Rows(1, 0, 1),
    aten.bmm: Rows(0, 1, 2),
    SDPA: Rows(0, 1, 3),  # q, k and v as [1, rows × heads, tokens, head dim]: cut by pairs
}
MAX_OP_BYTES = 1 << 30  # an op whose tensors take more at its most cut is not timed


@dataclass(frozen=True)
class CpuFacts:
    """What decides how fast a CPU runs bfloat16 against float32: the cache key. The name alone
    is not enough (AMX and AVX-512-only Xeons may both report "Intel(R) Xeon(R) Processor")."""

    processor: str
    model: str  # "family/model/stepping" as /proc/cpuinfo numbers them
    flags: tuple[str, ...]  # of BF16_FLAGS, those this CPU has
    threads: int
    torch: str

    @classmethod
    def of_this_host(cls, threads: int) -> CpuFacts:
        fields: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
                if not line.strip():
                    break  # the first processor's fields describe them all
        have = set(fields.get("flags", "").split())
        return cls(
            processor=fields.get("model name", "unknown"),
            model="/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping")),
            flags=tuple(f for f in BF16_FLAGS if f in have),
            threads=threads,
            torch=torch.__version__,
        )

    def as_json(self) -> dict[str, Any]:
        """As the cache and /v1/stats hold it (a list of flags: what JSON reads back)."""
        return asdict(self) | {"flags": list(self.flags)}

    @property
    def native_bf16(self) -> bool:
        return "amx_bf16" in self.flags or "avx512_bf16" in self.flags


@dataclass(frozen=True)
class TensorShape:
    shape: tuple[int, ...]
    order: tuple[int, ...]  # the dimensions from outermost to innermost in memory
    floating: bool


@dataclass(frozen=True)
class RecordedOp:
    """One op the forward runs, as it ran: its tensors' shapes and layouts, its other arguments."""

    name: str  # the aten op, e.g. "aten.convolution"
    args: tuple[Any, ...]  # TensorShape where a tensor was
    kwargs: tuple[tuple[str, Any], ...]
    flops: float  # of one run

    def describe(self) -> str:
        shapes = " ".join("×".join(map(str, a.shape)) for a in self.args if isinstance(a, TensorShape))
        return f"{self.name.removeprefix('aten.')} {shapes}"


@dataclass(frozen=True)
class OpTiming:
    op: str  # RecordedOp.describe()
    count: int  # runs per forward
    share: float  # of the forward's FLOPs
    float32_s: float  # per run, at full size
    bfloat16_s: float
    rounds: int


@dataclass(frozen=True)
class DtypeChoice:
    """What `--dtype auto` serves on a CPU, and why."""

    dtype: str
    reason: str
    gain: float | None = None  # the model's float32 seconds over its bfloat16 seconds
    threshold: float = BF16_GAIN
    ops: tuple[OpTiming, ...] = ()
    facts: CpuFacts | None = None
    rows: int | None = None  # the call timed: a full step's rows

    def view(self) -> dict[str, Any]:
        """For /v1/stats and the log."""
        return {
            "dtype": self.dtype,
            "reason": self.reason,
            "bf16_gain": None if self.gain is None else round(self.gain, 3),
            "rows": self.rows,
            "threshold": self.threshold,
            "ops": [
                {
                    "op": t.op,
                    "count": t.count,
                    "flops_share": round(t.share, 3),
                    "float32_ms": round(t.float32_s * 1e3, 3),
                    "bfloat16_ms": round(t.bfloat16_s * 1e3, 3),
                    "rounds": t.rounds,
                }
                for t in self.ops
            ],
            "cpu": None if self.facts is None else self.facts.as_json(),
        }

    @classmethod
    def read(cls, stored: dict[str, Any]) -> DtypeChoice:
        """A choice kept by `asdict` in the cache."""
        ops = tuple(OpTiming(**t) for t in stored["ops"])
        facts = stored["facts"] and CpuFacts(**(stored["facts"] | {"flags": tuple(stored["facts"]["flags"])}))
        return cls(**(stored | {"ops": ops, "facts": facts}))


def choose_cpu_dtype(
    model: nn.Module, latent_size: int, threads: int, cache_dir: Path | None, rows: int
) -> DtypeChoice:
    """bfloat16 or float32 for `model` (its weightless twin is enough) on this CPU with `threads`
    threads, at `rows` rows of `latent_size`² latents (a full step's: where a loaded server spends
    its time; a small model gains more from bfloat16 the more rows a call has): read from
    `cache_dir` when this host timed this model's ops before, else timed now (seconds) and kept."""
    facts = CpuFacts.of_this_host(threads)
    if not facts.native_bf16:
        return DtypeChoice(
            "float32", "bfloat16 is emulated on this CPU (no avx512_bf16 or amx_bf16)", facts=facts
        )
    ops = record_ops(model, rows, latent_size)
    digest = hashlib.sha256(repr(sorted(map(repr, ops.items()))).encode()).hexdigest()[:16]
    key = {"dtype_choice": facts.as_json(), "ops": digest}
    path = cache_dir / "calibration.json" if cache_dir is not None else None
    if isinstance(stored := lookup(path, key), dict):
        with contextlib.suppress(TypeError, KeyError):  # written by another version: time again
            return DtypeChoice.read(stored)
    try:
        timings = time_heaviest(ops, threads)
    except RuntimeError as err:  # a kernel this CPU's torch lacks in one dtype: not kept, tried next start
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        return DtypeChoice("float32", f"timing the model's ops failed ({first})", facts=facts, rows=rows)
    if not timings:  # every heavy op over MAX_OP_BYTES: nothing to decide by
        return DtypeChoice("float32", "the heaviest ops are too large to time", facts=facts, rows=rows)
    gain = model_gain(timings)
    served = "bfloat16" if gain >= BF16_GAIN else "float32"
    reason = (
        f"the model's heaviest ops ran {gain:.2f}x faster in bfloat16 than in float32 at {rows} rows "
        f"on this CPU ({', '.join(facts.flags)}, {threads} threads), "
        f"{'at least' if served == 'bfloat16' else 'under'} {BF16_GAIN}x"
    )
    choice = DtypeChoice(served, reason, gain, BF16_GAIN, timings, facts, rows)
    store(path, key, asdict(choice))
    return choice


def model_gain(timings: Iterable[OpTiming]) -> float:
    """The forward's float32 seconds over its bfloat16 seconds, over the ops timed."""
    timings = list(timings)
    full = sum(t.count * t.float32_s for t in timings)
    half = sum(t.count * t.bfloat16_s for t in timings)
    return full / max(half, 1e-12)


def settle(rounds: Iterable[tuple[float, float]]) -> tuple[float, float, int]:
    """The best float32 and bfloat16 seconds of an op from its rounds (each a (float32, bfloat16)
    pair of timings), taken until each best has been met twice (two runs within AGREE of it), or
    MOST_ROUNDS; and the rounds taken. What a busy neighbour adds to a run is dropped by the
    bests, and a best met once may be a lucky run between its bursts: two agreeing say quiet."""
    full: list[float] = []
    half: list[float] = []
    for taken, (full_s, half_s) in enumerate(rounds, start=1):
        full.append(full_s), half.append(half_s)
        if taken >= MOST_ROUNDS or (_met_twice(full) and _met_twice(half)):
            break
    return min(full), min(half), len(full)


def _met_twice(runs: list[float]) -> bool:
    best = min(runs)
    return sum(run <= best * (1 + AGREE) for run in runs) >= 2


def time_heaviest(ops: Counter[RecordedOp], threads: int) -> tuple[OpTiming, ...]:
    """The heaviest of `ops` (by FLOPs a forward, up to COVERAGE of them or MOST_OPS), each timed
    in float32 and bfloat16 in turn (`settle`), with `threads` intra-op threads."""
    total = sum(op.flops * n for op, n in ops.items()) or 1.0
    heaviest = sorted(ops.items(), key=lambda item: -item[0].flops * item[1])
    timings, covered = [], 0.0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for op, count in heaviest[:MOST_OPS]:
                if covered >= COVERAGE:
                    break
                if _op_bytes(op, _scales(op)[-1]) > MAX_OP_BYTES:
                    continue  # its share is left out of the gain
                full, half, taken = settle(_rounds(op))
                share = op.flops * count / total
                timings.append(OpTiming(op.describe(), count, share, full, half, taken))
                covered += share
    finally:
        torch.set_num_threads(before)
    return tuple(timings)


def _rounds(op: RecordedOp) -> Iterator[tuple[float, float]]:
    """Rounds of (float32, bfloat16) seconds of `op` at full size, the order of the two swapped
    every round. A long op runs with its rows divided by a power of two (`_scales`) and its times
    scaled back: the largest share that runs within RUN_S, found from the smallest up."""
    scales = _scales(op)
    scale = scales.pop()
    full = _runnable(op, torch.float32, scale)
    full()  # warm: kernels chosen, weights reordered where oneDNN does
    took = _timed(full)
    while scales and 2 * took <= RUN_S:
        scale = scales.pop()
        full = _runnable(op, torch.float32, scale)
        full()
        took = _timed(full)
    half = _runnable(op, torch.bfloat16, scale)
    half()
    repeats = max(1, math.ceil(SAMPLE_S / max(took, 1e-6)))  # a tiny op: its runs timed together
    for index in itertools.count():
        if index % 2:
            half_s, full_s = _timed(half, repeats), _timed(full, repeats)
        else:
            full_s, half_s = _timed(full, repeats), _timed(half, repeats)
        yield full_s * scale, half_s * scale


def _timed(run: Callable[[], object], repeats: int = 1) -> float:
    """Seconds a run of `run` takes, over `repeats` runs back to back."""
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats


def _scales(op: RecordedOp) -> list[int]:
    """What `op`'s rows may be divided by: 1, 2, 4, … while MIN_ROWS GEMM rows are left, its
    other tensors keeping their shapes (an attention's q, k and v cut together, by pairs of row
    and head: `_runnable`)."""
    func = getattr(aten, op.name.removeprefix("aten."))
    rows = ROWS.get(func)
    others: list[Any] = []  # tensors whose rows would have to be cut with the halved one's
    if func is SDPA:
        others = [*op.args[3:], *(v for _, v in op.kwargs)]  # an attention mask
        if not _flattens(op):
            return [1]  # grouped-query attention (k and v have fewer heads), or a mask
    elif func is aten.addmm:
        others = [op.args[0]]  # the bias
    if rows is None or any(isinstance(a, TensorShape) and len(a.shape) > 1 for a in others):
        return [1]
    shape = _shape_at(op, rows.arg, 1)
    gemm_rows = math.prod(shape) // shape[rows.features]
    scales = [1]
    while gemm_rows // (scales[-1] * 2) >= MIN_ROWS and shape[rows.halved] // (scales[-1] * 2) >= 1:
        scales.append(scales[-1] * 2)
    return scales


def _flattens(op: RecordedOp) -> bool:
    """Whether an attention's q, k and v may be cut by (row, head) pairs: the same pairs in all
    three, and no mask beside them."""
    q, k, v = op.args[:3]
    masked = any(isinstance(a, TensorShape) for a in [*op.args[3:], *(v for _, v in op.kwargs)])
    return not masked and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]


def _shape_at(op: RecordedOp, index: int, scale: int) -> list[int]:
    """Argument `index`'s shape as timed at `scale`: an attention's q, k and v as [1, rows × heads,
    tokens, head dim], pairs divided by `scale`; else the op's `halved` dimension."""
    func = getattr(aten, op.name.removeprefix("aten."))
    rows, arg = ROWS.get(func), op.args[index]
    shape = list(arg.shape)
    if func is SDPA and index < 3 and _flattens(op):
        return [1, max(1, math.prod(shape[:-2]) // scale), *shape[-2:]]  # 4-D: CPU flash attention's
    if rows is not None and index == rows.arg:
        shape[rows.halved] = max(1, shape[rows.halved] // scale)
    return shape


def _op_bytes(op: RecordedOp, scale: int) -> int:
    """Bytes of `op`'s tensors at `scale`, in float32."""
    shapes = [_shape_at(op, i, scale) for i, a in enumerate(op.args) if isinstance(a, TensorShape)]
    shapes += [list(v.shape) for _, v in op.kwargs if isinstance(v, TensorShape)]
    return 4 * sum(math.prod(shape) for shape in shapes)


def _runnable(op: RecordedOp, dtype: torch.dtype, scale: int) -> Callable[[], object]:
    """`op` on random tensors of its shapes and layouts in `dtype`, its rows divided by `scale`."""
    func = getattr(aten, op.name.removeprefix("aten."))
    generator = torch.Generator().manual_seed(0)

    def make(index: int, arg: Any) -> Any:
        if not isinstance(arg, TensorShape):
            return arg
        kind = dtype if arg.floating else torch.float32
        shape = _shape_at(op, index, scale) if index >= 0 else list(arg.shape)
        if shape[:-2] != list(arg.shape[:-2]) and func is SDPA:  # q, k or v by pairs: laid out anew
            return torch.randn(shape, generator=generator, dtype=kind)
        inner = torch.randn([shape[d] for d in arg.order], generator=generator, dtype=kind)
        tensor = inner.permute([arg.order.index(d) for d in range(len(shape))])
        return tensor if arg.floating else tensor.bool()

    args = [make(i, a) for i, a in enumerate(op.args)]
    kwargs = {k: make(-1, v) for k, v in op.kwargs}
    return lambda: func(*args, **kwargs)


def record_ops(model: nn.Module, rows: int, latent_size: int) -> Counter[RecordedOp]:
    """The convolutions, matrix products and attentions one forward of `model` runs, at `rows`
    rows of `latent_size`² latents, counted by their shapes (on a weightless twin: nothing runs)."""
    with torch.device("meta"):
        twin = type(model).from_config(model.config)
    twin = as_loaded(twin, torch.float32).eval()
    spec = spec_for(twin)
    recorder = _Recorder()
    inputs = spec.example_inputs(twin, rows, latent_size, torch.float32, torch.device("meta"))
    with torch.inference_mode(), recorder:
        walk_plain(spec, twin, inputs)
    return recorder.seen


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[RecordedOp] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet not in ROWS and packet not in flop_registry:
            with self:  # what a composite op (linear, conv2d) runs as
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if packet in ROWS:
            if packet is SDPA:
                flops = float(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
            else:
                flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            shaped = tuple(map(_shape_of, args)), tuple((k, _shape_of(v)) for k, v in sorted(kwargs.items()))
            self.seen[RecordedOp(f"aten.{packet.__name__}", *shaped, flops)] += 1
        return out


def _shape_of(value: Any) -> Any:
    """An argument as recorded: a tensor's shape and layout, a list as a tuple (hashable)."""
    if isinstance(value, list | tuple):
        return tuple(map(_shape_of, value))
    if not isinstance(value, torch.Tensor):
        return value
    order = tuple(sorted(range(value.dim()), key=lambda d: (-value.stride(d), d)))
    return TensorShape(tuple(value.shape), order, value.is_floating_point())
