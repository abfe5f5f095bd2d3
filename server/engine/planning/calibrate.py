"""How fast a device runs each kind of work: a few short timings, cached on disk.

The cost model (`costs.py`) turns counted work (`work.py`) into seconds with five numbers per
(device kind, dtype, threads): FLOP/s of matrix products, of convolutions and of attention,
bytes/s of memory-bound ops, and seconds of overhead per op. Each is timed on an op shaped like
an SD-sized block's (3×3 convolutions of 320 channels at 32² and of 1280 at 8² and 4²,
linears of 2048 and 32 rows, 8-head attention over 1024 tokens), scaled down until one run
fits 0.1 s,
so a slow dtype (bfloat16 emulated on an AVX2 CPU is ~180× slower than float32) still
calibrates in about a second. All of it takes at most ~3 s, once per host: the result is kept
in the cache directory, keyed by the host's processor, the torch version and the thread count.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch import nn

from server.engine.hardware.devices import device_kind
from server.engine.hardware.threads import set_intra_op_threads
from server.engine.planning.cache import lookup, store
from server.engine.planning.work import count_ops

RUN_S = 0.1  # one timed run of a calibration op at most this long (smaller shapes when slower)
REPEATS = 3  # timed runs per op after a warm-up; the fastest counts


@dataclass(frozen=True)
class DeviceSpeed:
    """What one worker (`threads` intra-op threads on a `device` of this kind) does per second."""

    device: str  # "cpu", or a CUDA device's name
    dtype: str
    threads: int
    matmul: tuple[tuple[int, float], ...]  # (GEMM rows, FLOP/s) timed: small GEMMs run below peak
    conv: tuple[tuple[int, float], ...]
    attention_flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float  # per op, a module's Python and dispatch included

    def __post_init__(self) -> None:  # read back from JSON, pairs are lists
        object.__setattr__(self, "matmul", tuple(tuple(p) for p in self.matmul))
        object.__setattr__(self, "conv", tuple(tuple(p) for p in self.conv))

    def rate(self, kind: str, rows: int) -> float:
        """FLOP/s of a `kind` op whose GEMM has `rows` rows: log-linear between the sizes timed."""
        if kind == "attention":
            return self.attention_flops_per_s
        points = self.matmul if kind == "matmul" else self.conv
        x = math.log2(max(rows, 1))
        for (r0, v0), (r1, v1) in itertools.pairwise(points):
            if x <= math.log2(r1):
                share = min(1.0, max(0.0, (x - math.log2(r0)) / (math.log2(r1) - math.log2(r0))))
                return v0 ** (1 - share) * v1**share
        return points[-1][1]


def calibrate(device: str, dtype: torch.dtype, threads: int = 1) -> DeviceSpeed:
    """Time the five numbers on `device` with `threads` intra-op threads (on CUDA, threads are 1)."""
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            speed = DeviceSpeed(
                device=device_kind(device),
                dtype=str(dtype).removeprefix("torch."),
                threads=threads,
                matmul=tuple(
                    (rows, _rate(lambda s, r=rows: _matmul(r, s, dtype, dev), sync)) for rows in (32, 2048)
                ),
                conv=tuple(
                    (rows, _rate(lambda s, r=rows: _conv(r, s, dtype, dev), sync)) for rows in (32, 128, 2048)
                ),
                attention_flops_per_s=_rate(lambda s: _attention(s, dtype, dev), sync),
                bytes_per_s=_rate(lambda s: _memory(s, dtype, dev), sync),
                op_overhead_s=_op_overhead(dtype, dev, sync),
            )
    finally:
        torch.set_num_threads(before)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # later memory readings must not see the calibration's
    return speed


def cached_calibration(device: str, dtype: torch.dtype, threads: int, cache_dir: Path | None) -> DeviceSpeed:
    """`calibrate`, read from `cache_dir` when this host calibrated this case before."""
    threads = threads if torch.device(device).type == "cpu" else 1
    key = {"device": device_kind(device), "dtype": str(dtype), "threads": threads, "torch": torch.__version__}
    path = cache_dir / "calibration.json" if cache_dir is not None else None
    stored = lookup(path, key)
    if stored is not None:
        try:
            return DeviceSpeed(**stored)
        except TypeError:  # written by another version of diffshard: calibrate again
            pass
    speed = calibrate(device, dtype, threads)
    store(path, key, asdict(speed))
    return speed


def _rate(make: Callable[[int], tuple[Callable[[], object], float]], sync: Callable[[], None]) -> float:
    """Units per second of the op `make(scale)` prepares (with its units: FLOPs or bytes), at the
    largest scale (1, 1/2, 1/4, …) whose warm run takes at most RUN_S."""
    scale = 1
    while True:
        run, units = make(scale)
        took = _timed(run, sync)
        if took > RUN_S and scale == 1:  # the process's first run may be cold (kernels loaded,
            took = _timed(run, sync)  # handles and caches made): decide on a warm one
        if took <= RUN_S or scale >= 64:
            break
        scale *= 2
    best = min(_timed(run, sync) for _ in range(REPEATS))
    return units / max(best, 1e-9)


def _timed(run: Callable[[], object], sync: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - started


Op = tuple[Callable[[], object], float]


def _matmul(rows: int, scale: int, dtype: torch.dtype, device: torch.device) -> Op:
    """`rows` tokens through a projection as wide as that level's: 320 → 1280 at the widest
    (2 rows × 32² tokens), 1280 → 1280 at the deepest (2 × 4²)."""
    width, out = (320, 1280) if rows >= 1024 else (1280, 1280)
    width, out = max(64, width // scale), max(64, out // scale)
    x = torch.randn(rows, width, dtype=dtype, device=device)
    w = torch.randn(out, width, dtype=dtype, device=device)
    return (lambda: F.linear(x, w)), 2.0 * rows * width * out


def _conv(rows: int, scale: int, dtype: torch.dtype, device: torch.device) -> Op:
    """A 3×3 convolution with `rows` output pixels (2 images), as many channels as SD's level of
    that size has: 320 at 32², 1280 at 8² and 4²."""
    side = math.isqrt(rows // 2)
    channels = max(32, (320 if side >= 32 else 1280) // scale)
    x = torch.randn(2, channels, side, side, dtype=dtype, device=device)
    w = torch.randn(channels, channels, 3, 3, dtype=dtype, device=device)
    b = torch.randn(channels, dtype=dtype, device=device)
    return (lambda: F.conv2d(x, w, b, padding=1)), 2.0 * rows * channels * channels * 9


def _attention(scale: int, dtype: torch.dtype, device: torch.device) -> Op:
    tokens = max(64, 1024 // scale)
    q, k, v = (torch.randn(2, 8, tokens, 40, dtype=dtype, device=device) for _ in range(3))
    return (lambda: F.scaled_dot_product_attention(q, k, v)), 4.0 * 2 * 8 * tokens * tokens * 40


def _memory(scale: int, dtype: torch.dtype, device: torch.device) -> Op:
    numel = max(1 << 16, (8 << 20) // scale)  # 32 MiB of float32: past the caches
    a, b = torch.randn(numel, dtype=dtype, device=device), torch.randn(numel, dtype=dtype, device=device)
    out = torch.empty_like(a)
    return (lambda: torch.add(a, b, out=out)), 3.0 * numel * a.element_size()  # two read, one written


def _op_overhead(dtype: torch.dtype, device: torch.device, sync: Callable[[], None]) -> float:
    """Seconds per op of a diffusers resnet and transformer block on tiny tensors: dispatch,
    launch and the blocks' own Python (attention processors, shape checks), not arithmetic."""
    run = _small_blocks(dtype, device, side=4)
    ops = len(count_ops(run).ops)
    best = float("inf")
    for _ in range(REPEATS + 2):
        started = time.perf_counter()
        for _ in range(5):
            run()
        sync()
        best = min(best, time.perf_counter() - started)
    return best / (5 * ops)


def shared_overhead(speed: DeviceSpeed, workers: int, threads: int, beside_server: bool) -> float:
    """Seconds per op, beyond its arithmetic, when `workers` CPU workers (a thread each, `threads`
    intra-op threads each) run a small model's blocks at once, as lanes do; with
    `beside_server`, next to a thread busy half the time, as the server's own threads are when
    the workers fill the quota. This is what sharing costs that FLOPs do not show: the workers'
    Python takes turns under the interpreter lock, and an OpenMP team waits at every parallel
    op for any of its threads that the scheduler took off a core."""
    dtype = getattr(torch, speed.dtype)
    run = _small_blocks(dtype, torch.device("cpu"), side=16)
    work = count_ops(run)
    arithmetic = sum(
        max(op.flops / speed.rate(op.kind, op.rows), op.bytes / speed.bytes_per_s) for op in work.ops
    )
    repeats, start = 8, threading.Barrier(workers + 1)
    spent: list[float] = []

    def worker() -> None:
        set_intra_op_threads(threads)
        with torch.inference_mode():
            run()  # warm: this thread's OpenMP team, the allocator's caches
            start.wait()
            began = time.perf_counter()
            for _ in range(repeats):
                run()
            spent.append(time.perf_counter() - began)

    pool = [threading.Thread(target=worker) for _ in range(workers)]
    with busy_server() if beside_server else contextlib.nullcontext():
        for t in pool:
            t.start()
        start.wait()
        for t in pool:
            t.join()
    per_op = statistics.median(spent) / repeats / len(work.ops)
    return max(speed.op_overhead_s, per_op - arithmetic / len(work.ops))


@contextlib.contextmanager
def busy_server() -> Iterator[None]:
    """A thread busy half the time in Python (a millisecond spinning, a millisecond asleep): what
    the planner assumes the server's own threads take while CPU workers fill the quota."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            until = time.perf_counter() + 1e-3
            while time.perf_counter() < until:
                pass
            time.sleep(1e-3)

    thread = threading.Thread(target=spin, name="diffshard-busy-server", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def cached_shared_overhead(
    speed: DeviceSpeed, workers: int, threads: int, beside_server: bool, cache_dir: Path | None
) -> float:
    key = {
        "device": speed.device,
        "dtype": speed.dtype,
        "workers": workers,
        "threads": threads,
        "beside_server": beside_server,
        "torch": torch.__version__,
    }
    path = cache_dir / "calibration.json" if cache_dir is not None else None
    stored = lookup(path, key)
    if isinstance(stored, float):
        return stored
    seconds = shared_overhead(speed, workers, threads, beside_server)
    store(path, key, seconds)
    return seconds


def _small_blocks(dtype: torch.dtype, device: torch.device, side: int) -> Callable[[], object]:
    """A diffusers resnet and transformer block, 32 channels, on 2 rows of `side`² latents."""
    resnet = ResnetBlock2D(in_channels=32, temb_channels=32, groups=8).to(device, dtype).eval()
    attention = Transformer2DModel(2, 16, in_channels=32, norm_num_groups=8, cross_attention_dim=32)
    attention = nn.Module.to(attention, device, dtype).eval()  # without diffusers' dtype warning
    x = torch.randn(2, 32, side, side, dtype=dtype, device=device)
    temb = torch.randn(2, 32, dtype=dtype, device=device)
    context = torch.randn(2, 8, 32, dtype=dtype, device=device)
    return lambda: attention(resnet(x, temb), encoder_hidden_states=context, return_dict=False)
