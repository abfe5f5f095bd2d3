"""The GPU check's compile phases: `--compile blocks` (inductor, each block kind) against eager
at a model's lone rows, through our ModelShard walk, on the just-in-time route (the one a
PyTorch without `aot_compile` has: the GPU image's 2.11). With `--float8`, a second copy of the
model quantized as `--quantize float8` does (rowwise, torchao) and compiled the same way, against
the bfloat16 eager step: what float8 gains once its scaling is fused, and its difference from
bfloat16 (the bound a user's images keep). On a CPU, int8-dynamic stands in for float8.

`--cache-dir DIR`: inductor's caches and the compile's cache artifacts, kept there at the end
(`GraphStore.keep_artifacts`) and loaded at the start when a previous run left them: the check
copies them back with its report, so the next lease's first calls can reuse them.

    python -m benchmarks.gpu.compiled flux --float8 --device cuda --cache-dir DIR --lines FILE
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from benchmarks.gpu import Lines, phase_parser
from benchmarks.gpu.models import Clock, paired, relative
from benchmarks.gpu.shapes import SHAPES, TINY, Shape, build_on_device, inputs_for
from benchmarks.gpu_check import ARTIFACTS
from server.engine import CallPlan, ModelShard, plan_shards
from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.quantize import Quantization, QuantMode, refusal
from server.engine.runtime.compile import CompileMode
from server.engine.runtime.graphs import CompileRoute, CompileStats, GraphStore


def compiled_shard(
    model: nn.Module, shape: Shape, lone: DenoiserInputs, cache_dir: Path | None, clock: Clock
) -> tuple[ModelShard, CompileStats, float]:
    """`model` behind a shard whose lone-row bucket is compiled: the shard, its stats, and the
    compile's seconds (cache artifacts in `cache_dir` loaded first; this process's kept after)."""
    device = lone.sample.device
    shard = ModelShard(model, plan_shards(model, [str(device)], "even", latent_size=shape.latent[-1]))
    stats = CompileStats(CompileMode.BLOCKS.value)
    store = GraphStore(cache_dir, [device], stats, route=CompileRoute.JIT)
    shard.compile(CompileMode.BLOCKS, store)
    seconds, _ = clock(lambda: shard.warm(lone, shape.lone))
    store.keep_artifacts()
    return shard, stats, seconds


def bench_compiled(
    name: str,
    shape: Shape,
    device: torch.device,
    rounds: int,
    float8: bool,
    cache_dir: Path | None,
    cache: str,
    lines: Lines,
) -> None:
    dtype, clock = torch.bfloat16, Clock(device)
    model = build_on_device(shape, dtype, device)
    lone = inputs_for(model, shape, shape.lone, dtype, device)
    shard, stats, compile_s = compiled_shard(model, shape, lone, cache_dir, clock)
    compiled = lambda s=shard: s.run(lone, CallPlan.plain(shape.lone)).out  # noqa: E731
    eager_plan = replace(CallPlan.plain(shape.lone), compiled=False)
    eager = lambda: shard.run(lone, eager_plan).out  # noqa: E731
    timing = paired(clock, compiled, eager, rounds)
    reference = eager()
    lines.write(
        {
            "model": name,
            "measure": "compile_blocks",
            "route": stats.route,
            "cache": cache,
            "compile_s": round(compile_s, 1),
            "compiled_ms": timing["a_ms"],
            "eager_ms": timing["b_ms"],
            "ratio": timing["ratio"],
            "calls": dict(stats.calls),
            "relative_difference": round(relative(compiled(), reference), 5),
        }
    )
    ratio = timing["ratio"]
    headline = f"{name} compiled ({stats.route}) {ratio:.3f}x eager ({compile_s:.0f} s to compile, {cache})"
    if float8:
        headline += "; " + quantized_and_compiled(
            name, shape, lone, eager, reference, cache_dir, clock, rounds, lines
        )
    lines.write({"headline": headline})


def quantized_and_compiled(
    name: str,
    shape: Shape,
    lone: DenoiserInputs,
    eager: Callable[[], torch.Tensor],
    reference: torch.Tensor,
    cache_dir: Path | None,
    clock: Clock,
    rounds: int,
    lines: Lines,
) -> str:
    """A second copy quantized in place (bfloat16's stays, for the paired rounds: FLUX.1-dev's
    23.8 GB and 12 GB beside it fit every card the check runs on), compiled, against `eager`."""
    device = lone.sample.device
    mode = QuantMode.FLOAT8 if device.type == "cuda" else QuantMode.INT8_DYNAMIC
    if problem := refusal(mode, str(device)):
        lines.write({"model": name, "measure": "compile_quantized", "refused": problem})
        return f"{mode} refused"
    model = build_on_device(shape, torch.bfloat16, device)
    Quantization(mode, shape.keep_precise).apply(model)
    shard, stats, compile_s = compiled_shard(model, shape, lone, cache_dir, clock)
    compiled = lambda: shard.run(lone, CallPlan.plain(shape.lone)).out  # noqa: E731
    timing = paired(clock, compiled, eager, rounds)
    lines.write(
        {
            "model": name,
            "measure": "compile_quantized",
            "mode": str(mode),
            "compile_s": round(compile_s, 1),
            "compiled_ms": timing["a_ms"],
            "bf16_eager_ms": timing["b_ms"],
            "ratio": timing["ratio"],
            "calls": dict(stats.calls),
            "relative_difference": round(relative(compiled(), reference), 5),  # against bfloat16's
        }
    )
    return f"{mode} compiled {timing['ratio']:.3f}x bf16 eager ({compile_s:.0f} s to compile)"


def main() -> None:
    parser = phase_parser(__doc__)
    parser.add_argument("models", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--float8", action="store_true", help="and a float8 copy, compiled")
    parser.add_argument("--cache-dir", type=Path, help="compile caches: loaded if there, kept at the end")
    args = parser.parse_args()
    lines = Lines(args.lines)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    shapes = TINY if args.quick else SHAPES
    # whether this phase began with an earlier one's (or an earlier run's) artifacts to load
    seeded = args.cache_dir is not None and any(args.cache_dir.glob(ARTIFACTS))
    cache = "from cache artifacts" if seeded else "cold"
    for name in args.models:
        rounds = 2 if args.quick else 5
        bench_compiled(name, shapes[name], device, rounds, args.float8, args.cache_dir, cache, lines)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
    gc.freeze()  # exit skips sweeping every module's objects (~1.5 s a phase)
