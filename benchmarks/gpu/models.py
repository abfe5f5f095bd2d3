"""The GPU check's real-shape benchmarks: published denoisers (`shapes.py`) with random weights made
on the device, in bfloat16, measured in this order (a phase cut short keeps what finished; the
largest models take the first two and memory alone, `LIGHT`):
1. a lone step (the family's rows: 2 under guidance, FLUX.1-dev's 1) through our ModelShard
   against diffusers' own forward, in paired rounds: the median of the ratios, and the outputs'
   relative difference;
2. step batching: rows/s at each row count;
3. first-block caching: a call whose rows reuse their kept features against a full one;
4. memory three ways: our shard's reading (what /v1/shards and the metrics show),
   `torch.cuda.max_memory_allocated`, `nvidia-smi`;
5. float8 (torchao, per row, as `--quantize float8`) against bfloat16: step time, held bytes,
   relative difference. On the CPU, int8-dynamic stands in (float8 needs a GPU's tensor cores).

    python -m benchmarks.gpu.models sdxl flux wan --device cuda --lines FILE
"""

from __future__ import annotations

import gc
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu import Lines, phase_parser
from benchmarks.gpu.shapes import SHAPES, TINY, GiB, Shape, build_on_device, free_gib, inputs_for
from server.engine import CallPlan, ModelShard, plan_shards
from server.engine.quantize import Quantization, QuantMode, refusal
from server.engine.runtime.call import CacheAsk, RowGroup
from tests.support.reference import diffusers_forward


class Clock:
    """Seconds of a call, the device synchronized around it."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        started = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - started, out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def paired(clock: Clock, first: Callable, second: Callable, rounds: int, warm: int = 3) -> dict[str, Any]:
    """Both `warm` times to warm (the GPU's clocks, cuDNN's choices), then `rounds` rounds in
    alternating order: medians and the median of paired ratios."""
    for _ in range(warm):
        clock(first), clock(second)
    a_s, b_s = [], []
    for r in range(rounds):
        order = [(first, a_s), (second, b_s)]
        for fn, times in order if r % 2 == 0 else order[::-1]:
            times.append(clock(fn)[0])
    return {
        "a_ms": round(statistics.median(a_s) * 1e3, 2),
        "b_ms": round(statistics.median(b_s) * 1e3, 2),
        "ratio": round(statistics.median(a / b for a, b in zip(a_s, b_s, strict=True)), 4),
        "rounds": rounds,
    }


def median_s(clock: Clock, fn: Callable, rounds: int) -> float:
    """One call to warm, then the median of `rounds` timed calls."""
    clock(fn)
    return statistics.median(clock(fn)[0] for _ in range(rounds))


def nvidia_smi_used_mib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return float(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def bench(name: str, shape: Shape, device: torch.device, rounds: int, lines: Lines) -> None:
    if (free := free_gib(device)) is not None and free < shape.free_gib:
        lines.write({"model": name, "skipped": f"needs {shape.free_gib:.0f} GiB free, {free:.0f} here"})
        lines.write({"headline": f"{name}: skipped ({free:.0f} GiB free, needs {shape.free_gib:.0f})"})
        return
    dtype = torch.bfloat16
    clock = Clock(device)
    built_s, model = clock(lambda: build_on_device(shape, dtype, device))
    shard = ModelShard(model, plan_shards(model, [str(device)], "even", latent_size=shape.latent[-1]))
    lone = inputs_for(model, shape, shape.lone, dtype, device)
    params = sum(p.numel() for p in model.parameters())
    lines.write(
        {"model": name, "what": shape.what, "params_b": round(params / 1e9, 3), "built_s": round(built_s, 1)}
    )
    light = "step_cache" not in shape.measures  # seconds a call: fewer rounds, one to warm
    rounds, warm = (min(rounds, 3), 1) if light else (rounds, 3)

    # 1. a lone step: ours against diffusers' own forward
    ours = lambda: shard.run(lone, CallPlan.plain(shape.lone)).out  # noqa: E731
    theirs = lambda: diffusers_forward(model, lone)  # noqa: E731
    timing = paired(clock, ours, theirs, rounds, warm)
    reference = theirs()
    lone_ms, difference = timing["a_ms"], relative(ours(), reference)
    lines.write(
        {
            "model": name,
            "measure": "lone_step",
            "rows": shape.lone,
            "ours_ms": timing["a_ms"],
            "diffusers_ms": timing["b_ms"],
            "ratio": timing["ratio"],
            "rounds": rounds,
            "relative_difference": round(difference, 5),
        }
    )
    headline = f"{name}: lone {shape.lone} rows {timing['a_ms']:.1f} ms ({timing['ratio']:.3f}x diffusers); "

    # 2. step batching
    per_rows = {}
    for rows in shape.rows:
        batch = inputs_for(model, shape, rows, dtype, device)
        step = lambda b=batch, r=rows: shard.run(b, CallPlan.plain(r))  # noqa: E731
        seconds = median_s(clock, step, max(2, rounds // 2))
        per_rows[rows] = round(rows / seconds, 2)
        lines.write(
            {
                "model": name,
                "measure": "batching",
                "rows": rows,
                "step_ms": round(seconds * 1e3, 2),
                "rows_per_s": per_rows[rows],
            }
        )
        del batch
    best = max(per_rows, key=per_rows.__getitem__)
    headline += f"{per_rows[best]:.2f} rows/s at {best}; "

    # 3. first-block caching: a refresh keeps the features, a reuse skips the deep blocks
    if "step_cache" in shape.measures:
        refresh = CallPlan((RowGroup(shape.lone, cache=CacheAsk()),))
        kept = shard.run(lone, refresh).outcomes[0].fresh
        reuse = CallPlan((RowGroup(shape.lone, cache=CacheAsk(kept=kept, refresh=False)),))
        cached = paired(clock, lambda: shard.run(lone, reuse).out, ours, rounds)
        lines.write(
            {
                "model": name,
                "measure": "step_cache",
                "reused_ms": cached["a_ms"],
                "full_ms": cached["b_ms"],
                "ratio": cached["ratio"],
            }
        )
        headline += f"cache {cached['ratio']:.2f}x; "

    # 4. memory three ways
    reading = shard.memory()[str(device)]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    memory = {
        "model": name,
        "measure": "memory",
        "ours": vars(reading),
        "max_allocated_gib": round(peak / GiB, 2) if peak else None,
        "nvidia_smi_used_mib": nvidia_smi_used_mib(),
    }
    lines.write(memory)

    # 5. float8 against bfloat16 (int8-dynamic on a CPU): quantized in place (a bfloat16 copy
    # beside it would not fit FLUX.1 twice over on every card), so against the lone step's median
    if "quantized" in shape.measures:
        mode = QuantMode.FLOAT8 if device.type == "cuda" else QuantMode.INT8_DYNAMIC
        if problem := refusal(mode, str(device)):
            lines.write({"model": name, "measure": "quantized", "refused": problem})
        else:
            held = shard.param_bytes()[str(device)]
            Quantization(mode, shape.keep_precise).apply(model)
            fast = round(median_s(clock, ours, rounds) * 1e3, 2)
            quantized = {
                "mode": str(mode),
                "ms": fast,
                "bf16_ms": lone_ms,
                "ratio": round(fast / lone_ms, 4),
                "held_gib": round(shard.param_bytes()[str(device)] / GiB, 2),
                "bf16_held_gib": round(held / GiB, 2),
                "relative_difference": round(relative(ours(), reference), 4),
            }
            lines.write({"model": name, "measure": "quantized", **quantized})
            headline += f"{quantized['mode']} {quantized['ratio']:.2f}x; "

    lines.write({"headline": headline + (f"{peak / GiB:.1f} GiB peak" if peak else "peak n/a")})


def main() -> None:
    parser = phase_parser(__doc__)
    parser.add_argument("models", nargs="+", choices=sorted(SHAPES))
    args = parser.parse_args()
    lines = Lines(args.lines)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    shapes = TINY if args.quick else SHAPES
    rounds = 2 if args.quick else 5
    for name in args.models:
        bench(name, shapes[name], device, rounds, lines)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


if __name__ == "__main__":
    main()
    gc.freeze()  # exit skips sweeping every module's objects (~1.5 s a phase)
