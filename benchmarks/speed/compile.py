"""The fast path, measured on this host: compiled denoisers (`--compile auto`, the default: full
graphs here, each bucket kept where measured faster) against eager ones.

1. `peak`: the host's own float32 matmul peak (a 2048³ GEMM, best of several, on torch's threads),
   the yardstick for every fraction below.
2. `startup`: seconds from `python -m server serve` to ready (the log's "ready:" line, the moment
   /readyz turns 200), eager, compiled cold (an empty cache directory) and compiled warm (the
   same directory again), and to the background compile's end (/v1/stats' compile.state).
   Target: warm at most 1.5x eager to ready.
3. `serving`: the built-in model over real HTTP (its recommended 25 steps), an eager and a warm
   compiled server side by side: lone latency (one client, paired rounds, alternating which
   server goes first) and images/s at 8 clients. Targets: lone compiled/eager at most 0.7,
   throughput compiled/eager at least 1.3x at 8 clients.
4. `sd15_unet`: an SD-1.5-architecture UNet (random weights, built from config), one forward of
   2 rows at latent 32² and 64², eager and compiled, with the FLOPs counted (on the meta device)
   over the time: the fraction of the peak each reaches.

One JSON object per measurement, then a summary object whose `meets_target` is computed from the
figures it prints. What a CPU run cannot show: CUDA graphs (`--compile` on a GPU) and their
effect on transfers between devices.

    python -m benchmarks.speed.compile [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from diffusers import UNet2DConditionModel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.serving.clients import client_loop, compiled_after
from benchmarks.serving.throughput import measure
from server.engine.denoisers.blocks import walk_plain
from server.engine.denoisers.specs import spec_for
from server.engine.hardware.threads import fit_threads
from server.engine.planning.plan import plan_shards
from server.engine.runtime.compile import CompileMode
from server.engine.runtime.graphs import CompileStats, GraphStore
from server.engine.runtime.shard import ModelShard
from tests.support.live import live_server

TARGET_LONE = 0.7
TARGET_THROUGHPUT_AT_8 = 1.3
TARGET_WARM_OVER_EAGER = 1.5
SD15 = {  # runwayml/stable-diffusion-v1-5's unet/config.json, the fields that differ from the defaults
    "sample_size": 64,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "block_out_channels": (320, 640, 1280, 1280),
}


def emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), flush=True)
    return record


def matmul_peak(threads: int, rounds: int) -> float:
    """FLOP/s of the best of `rounds` float32 2048³ GEMMs on `threads` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(rounds))
    return 2 * 2048**3 / best


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def startup(*args: str) -> tuple[float, Any]:
    """Seconds to ready of a server started with `args`, and the server (a context to exit)."""
    started = time.perf_counter()
    context = live_server(*args, startup_deadline_s=1800)  # a cold compile takes minutes
    server = context.__enter__()
    return time.perf_counter() - started, (context, server)


def serving(cache: Path, rounds: int, per_client: int) -> dict[str, Any]:
    """Startup times (to ready; then, compiled, to its graphs ready in the background), then lone
    latency and 8-client throughput, eager (`--compile off`) vs the default (`--compile auto`),
    its graphs warm."""
    times: dict[str, float] = {}
    times["eager"], (eager_ctx, eager) = startup("--compile", "off")
    emit({"measure": "startup", "server": "eager", "seconds": round(times["eager"], 2)})
    began = time.perf_counter()
    cold, (ctx, server) = startup("--compile", "auto", "--cache-dir", str(cache))
    graphs_cold = compiled_after(server, began)
    ctx.__exit__(None, None, None)
    emit({"measure": "startup", "server": "compiled_cold", "seconds": round(cold, 2), "graphs": graphs_cold})
    began = time.perf_counter()
    times["compiled_warm"], (compiled_ctx, compiled) = startup("--compile", "auto", "--cache-dir", str(cache))
    graphs_warm = compiled_after(compiled, began)
    emit(
        {
            "measure": "startup",
            "server": "compiled_warm",
            "seconds": round(times["compiled_warm"], 2),
            "graphs": graphs_warm,
        }
    )
    try:
        servers = {"eager": eager, "compiled": compiled}
        lone: dict[str, list[float]] = {"eager": [], "compiled": []}
        for name in servers:  # each server's first requests warm its pool and caches
            client_loop(servers[name], 2, seed=99)
        for round_ in range(rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                lone[name].append(statistics.median(client_loop(servers[name], 3, seed=round_)))
        ratios = [c / e for c, e in zip(lone["compiled"], lone["eager"], strict=True)]
        emit({"measure": "lone", **{k: [round(v, 4) for v in vs] for k, vs in lone.items()}})
        at_8: dict[str, list[float]] = {"eager": [], "compiled": []}
        for round_ in range(rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                figures = measure(servers[name], 8, per_client)
                emit({"measure": "clients_8", "server": name, "round": round_, **figures})
                at_8[name].append(figures["images_per_s"])
        throughput = [c / e for c, e in zip(at_8["compiled"], at_8["eager"], strict=True)]
    finally:
        eager_ctx.__exit__(None, None, None)
        compiled_ctx.__exit__(None, None, None)
    return {
        "startup_s": {
            "eager": round(times["eager"], 2),
            "compiled_cold": round(cold, 2),
            "compiled_warm": round(times["compiled_warm"], 2),
            "graphs_ready_cold": graphs_cold["ready_after_s"],
            "graphs_ready_warm": graphs_warm["ready_after_s"],
        },
        "buckets": graphs_warm["buckets"],
        "warm_over_eager": round(times["compiled_warm"] / times["eager"], 3),
        "lone_s": {k: round(statistics.median(v), 4) for k, v in lone.items()},
        "lone_compiled_over_eager": round(statistics.median(ratios), 3),
        "images_per_s_at_8": {k: round(statistics.median(v), 3) for k, v in at_8.items()},
        "throughput_compiled_over_eager_at_8": round(statistics.median(throughput), 3),
    }


def sd15_unet(latents: list[int], cache: Path, peak: float, rounds: int) -> dict[str, Any]:
    """An SD-1.5 UNet's 2-row forward per latent size: eager and compiled seconds, and the fraction
    of `peak` each reaches (FLOPs counted on the meta device)."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SD15).eval()
    spec = spec_for(unet)
    shard = ModelShard(unet, plan_shards(unet, "cpu", "even"))
    stats = CompileStats("full")
    shard.compile(CompileMode.FULL, GraphStore(cache, torch.device("cpu"), stats))
    with torch.device("meta"):
        meta = UNet2DConditionModel(**SD15)
    out: dict[str, Any] = {}
    for side in latents:
        inputs = spec.example_inputs(unet, 2, side, torch.float32, torch.device("cpu"))
        with FlopCounterMode(display=False) as counter, torch.inference_mode():
            walk_plain(spec, meta, spec.example_inputs(meta, 2, side, torch.float32, torch.device("meta")))
        flops = counter.get_total_flops()
        started = time.perf_counter()
        shard.warm(inputs, 2)
        compile_s = time.perf_counter() - started

        def eager(inputs=inputs) -> None:
            with torch.inference_mode():
                walk_plain(spec, unet, inputs)

        def compiled(inputs=inputs) -> None:
            shard.compiled.whole(inputs)

        eager(), compiled()
        pairs = [(_timed(eager), _timed(compiled)) for _ in range(rounds)]
        e, c = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        out[side] = emit(
            {
                "measure": "sd15_unet",
                "latent": side,
                "rows": 2,
                "tflop": round(flops / 1e12, 3),
                "eager_s": round(e, 3),
                "compiled_s": round(c, 3),
                "compiled_over_eager": round(statistics.median(p[1] / p[0] for p in pairs), 3),
                "eager_fraction_of_peak": round(flops / e / peak, 3),
                "compiled_fraction_of_peak": round(flops / c / peak, 3),
                "compile_or_load_s": round(compile_s, 1),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds, the SD-1.5 UNet at 32² only")
    parser.add_argument(
        "--cache-dir", type=Path, help="where the SD-1.5 UNet's graphs are kept (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    threads = fit_threads(None)
    rounds = 3 if args.quick else 5
    peak = matmul_peak(threads, rounds)
    emit({"measure": "peak", "threads": threads, "gflop_per_s": round(peak / 1e9, 1)})
    with tempfile.TemporaryDirectory() as scratch:
        served = serving(Path(scratch) / "builtin", rounds, per_client=2 if args.quick else 4)
        unet = sd15_unet(
            [32] if args.quick else [32, 64], args.cache_dir or Path(scratch) / "sd15", peak, rounds
        )
    emit(
        {
            "summary": True,
            "host_peak_gflop_per_s": round(peak / 1e9, 1),
            **served,
            "sd15_unet": {
                str(k): {
                    f: v[f]
                    for f in ("compiled_over_eager", "eager_fraction_of_peak", "compiled_fraction_of_peak")
                }
                for k, v in unet.items()
            },
            "targets": {
                "lone_compiled_over_eager": TARGET_LONE,
                "throughput_compiled_over_eager_at_8": TARGET_THROUGHPUT_AT_8,
                "warm_over_eager": TARGET_WARM_OVER_EAGER,
            },
            "meets_target": {
                "lone": served["lone_compiled_over_eager"] <= TARGET_LONE,
                "throughput_at_8": served["throughput_compiled_over_eager_at_8"] >= TARGET_THROUGHPUT_AT_8,
                "warm_start": served["warm_over_eager"] <= TARGET_WARM_OVER_EAGER,
            },
            "cpu_cannot_show": "CUDA graphs and compiled kernels on GPUs; transfers between real devices",
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
