"""Quantized weights (`--quantize`) on this host: what each mode saves in bytes and costs or gains
in time, measured.

1. `peak`: the host's float32 and bfloat16 matmul peaks (2048³ GEMMs, best of several, on torch's
   threads): the yardsticks the forward times below are read against.
2. `linear_share`: an SD-1.5-architecture UNet (random weights, seed 0, built from
   `SD.reference_configs["sd15"]`): the share of its parameters in `nn.Linear` layers, and in the
   ones a mode converts (all but the family's `keep_precise` layers). Only those are quantized;
   a UNet keeps most of its weights in convolutions, which stay in the model's dtype.
3. `unet`: that UNet at batch 2 (one guided request), latent 32² and 64² (--quick: 32²), one
   forward per variant: float32, int8, int8-dynamic, and, where this CPU runs bfloat16 natively
   (`cpu_dtype()`), bfloat16 and bfloat16 + int8-dynamic, each applied as the server applies it
   (`Quantization(mode, SD.keep_precise).apply`). The variants run in interleaved rounds
   (alternating order; one variant held at a time, built afresh each round, a warm-up forward
   per side before the timed one); per variant the median forward time, and the median over rounds of its
   time over float32's in the same round. Bytes: the whole UNet's (`tensor_bytes`, which counts a
   quantized tensor's real parts) and the converted Linear layers' alone, each over float32's.
4. `serving`: 8 clients sending requests back to back (benchmarks/serving/throughput.py's clients: 25 steps,
   64x64) to the built-in model served per mode (`python -m server serve --quantize MODE`, and
   `--dtype bfloat16` where native), all servers up together and measured in interleaved rounds:
   images/s, and its median ratio to `off` over rounds. The built-in UNet is 4.5M parameters, its
   Linear layers tiny: this says what the modes' per-call overhead costs a small model, not what
   a large one gains.

No speed target: the issue asks for the figures. `meets_target` is a bytes check only: int8's
converted Linear layers hold at most half float32's bytes, and the whole-UNet byte figures (and
their ratio to float32) are printed for every variant.

CPU-only caveats: no float8 or nf4 (CUDA only), no GPU kernels; timings on a shared 2-core host
are noisy (hence paired rounds and medians); int8 weight-only saves memory bandwidth, which a
compute-bound CPU convolution barely feels.

    python -m benchmarks.speed.quantize [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.parallel.shard import build_unet
from benchmarks.serving.throughput import measure
from server.engine.denoisers.blocks import tensor_bytes
from server.engine.hardware.devices import cpu_dtype
from server.engine.hardware.threads import fit_threads
from server.engine.quantize import Quantization, QuantMode
from server.pipeline.families.sd import SD
from tests.support.live import live_server

MAX_LINEAR_BYTES_RATIO = 0.5  # int8's converted Linear layers over float32's
CLIENTS = 8


def emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), flush=True)
    return record


def timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def matmul_peak(dtype: torch.dtype, rounds: int) -> float:
    """FLOP/s of the best of `rounds` 2048³ GEMMs in `dtype`."""
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    a @ b
    return 2 * 2048**3 / min(timed(lambda: a @ b) for _ in range(rounds))


def variants(native_bf16: bool) -> dict[str, tuple[torch.dtype, QuantMode]]:
    out = {
        "fp32": (torch.float32, QuantMode.OFF),
        "int8": (torch.float32, QuantMode.INT8),
        "int8-dynamic": (torch.float32, QuantMode.INT8_DYNAMIC),
    }
    if native_bf16:
        out["bf16"] = (torch.bfloat16, QuantMode.OFF)
        out["bf16+int8-dynamic"] = (torch.bfloat16, QuantMode.INT8_DYNAMIC)
    return out


def linear_share(unet: nn.Module) -> dict[str, Any]:
    total = sum(p.numel() for p in unet.parameters())
    linear = sum(p.numel() for m in unet.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    converted = sum(m.weight.numel() for _, m in Quantization(QuantMode.INT8, SD.keep_precise).targets(unet))
    return {
        "parameters": total,
        "linear_share": round(linear / total, 4),
        "converted_weight_share": round(converted / total, 4),
        "conv_share": round(
            sum(p.numel() for m in unet.modules() if isinstance(m, nn.Conv2d) for p in m.parameters())
            / total,
            4,
        ),
    }


def build(base: nn.Module, dtype: torch.dtype, mode: QuantMode) -> nn.Module:
    """A variant of `base` as the server makes it: cast, then quantized but `SD.keep_precise`."""
    if dtype == torch.float32 and mode == QuantMode.OFF:
        return base
    model = copy.deepcopy(base).to(dtype)
    Quantization(mode, SD.keep_precise).apply(model)
    return model.eval()


def unet_times(sides: list[int], rounds: int, native_bf16: bool) -> dict[str, Any]:
    """Bytes per variant, and forward times per latent side in interleaved rounds. One variant is
    held at a time (built afresh each round and warmed up per side before its timed forward):
    every variant at once is ~12 GB, more than a shared host spares."""
    base = build_unet(SD.reference_configs["sd15"], torch.float32)
    share = emit({"measure": "linear_share", **linear_share(base)})
    targets = [name for name, _ in Quantization(QuantMode.INT8, SD.keep_precise).targets(base)]
    kinds = variants(native_bf16)
    fp32_bytes = tensor_bytes(base)
    fp32_linear = sum(tensor_bytes(base.get_submodule(t)) for t in targets)
    generator = torch.Generator().manual_seed(0)
    inputs = {
        side: (
            torch.randn(2, 4, side, side, generator=generator),
            torch.randn(2, 77, 768, generator=generator),
        )
        for side in sides
    }
    step = torch.full((2,), 500.0)
    sizes: dict[str, Any] = {}
    seconds: dict[int, dict[str, list[float]]] = {side: {name: [] for name in kinds} for side in sides}
    for round_ in range(rounds):
        order = list(kinds) if round_ % 2 == 0 else list(reversed(kinds))
        for name in order:
            dtype, mode = kinds[name]
            model = build(base, dtype, mode)
            if name not in sizes:
                linear = sum(tensor_bytes(model.get_submodule(t)) for t in targets)
                sizes[name] = emit(
                    {
                        "measure": "bytes",
                        "variant": name,
                        "unet_bytes": tensor_bytes(model),
                        "unet_over_fp32": round(tensor_bytes(model) / fp32_bytes, 4),
                        "converted_linear_bytes": linear,
                        "converted_linear_over_fp32": round(linear / fp32_linear, 4),
                        "saved_of_whole_unet": round(1 - tensor_bytes(model) / fp32_bytes, 4),
                    }
                )
            for side, (sample, context) in inputs.items():
                x, c = sample.to(dtype), context.to(dtype)
                with torch.inference_mode():
                    model(x, step, encoder_hidden_states=c)  # warm-up
                    seconds[side][name].append(
                        timed(lambda m=model, x=x, c=c: m(x, step, encoder_hidden_states=c))
                    )
            del model
        for side in sides:
            emit(
                {
                    "measure": "unet_forward",
                    "latent": side,
                    "rows": 2,
                    "round": round_,
                    **{f"{n}_s": round(s[-1], 3) for n, s in seconds[side].items()},
                }
            )
    times: dict[int, dict[str, Any]] = {}
    for side in sides:
        fp32 = seconds[side]["fp32"]
        times[side] = {
            name: {
                "median_s": round(statistics.median(s), 3),
                "time_over_fp32": round(statistics.median(a / b for a, b in zip(s, fp32, strict=True)), 3),
                "unet_bytes_over_fp32": sizes[name]["unet_over_fp32"],
                "converted_linear_bytes_over_fp32": sizes[name]["converted_linear_over_fp32"],
            }
            for name, s in seconds[side].items()
        }
        emit({"measure": "unet_medians", "latent": side, "rounds": rounds, **times[side]})
    return {"bytes": sizes, "times": times, "share": share}


def serving(rounds: int, per_client: int, native_bf16: bool) -> dict[str, Any]:
    flags = {
        "off": ("--quantize", "off"),
        "int8": ("--quantize", "int8"),
        "int8-dynamic": ("--quantize", "int8-dynamic"),
    }
    if native_bf16:
        flags["bf16"] = ("--quantize", "off", "--dtype", "bfloat16")
    rates: dict[str, list[float]] = {name: [] for name in flags}
    servers: dict[str, Any] = {}
    contexts = []
    try:
        for name, args in flags.items():
            contexts.append(live_server(*args))
            servers[name] = contexts[-1].__enter__()
        for server in servers.values():
            measure(server, 2, 1)  # warm-up
        for round_ in range(rounds):
            order = list(flags) if round_ % 2 == 0 else list(reversed(flags))
            for name in order:
                row = measure(servers[name], CLIENTS, per_client)
                rates[name].append(row["images_per_s"])
                emit({"measure": "serving", "clients": CLIENTS, "mode": name, "round": round_, **row})
    finally:
        for context in contexts:
            context.__exit__(None, None, None)
    return {
        name: {
            "images_per_s": round(statistics.median(r), 3),
            "over_off": round(statistics.median(a / b for a, b in zip(r, rates["off"], strict=True)), 3),
        }
        for name, r in rates.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="latent 32² only, 2 rounds; 1 serving round of 1 request a client",
    )
    args = parser.parse_args(argv)
    threads = fit_threads(None)
    native_bf16 = cpu_dtype() == torch.bfloat16
    peaks = {"fp32": matmul_peak(torch.float32, 5)}
    if native_bf16:
        peaks["bf16"] = matmul_peak(torch.bfloat16, 5)
    peak_gflops = {k: round(v / 1e9, 1) for k, v in peaks.items()}
    emit({"measure": "peak", "threads": threads, "native_bf16": native_bf16, "gflop_per_s": peak_gflops})
    unet = unet_times([32] if args.quick else [32, 64], 2 if args.quick else 3, native_bf16)
    served = serving(1 if args.quick else 2, 1 if args.quick else 2, native_bf16)
    int8_linear = unet["bytes"]["int8"]["converted_linear_over_fp32"]
    printed = all("unet_bytes" in row and "unet_over_fp32" in row for row in unet["bytes"].values())
    emit(
        {
            "summary": True,
            "threads": threads,
            "matmul_peak_gflop_per_s": peak_gflops,
            "linear_parameter_share": unet["share"]["linear_share"],
            "converted_weight_share": unet["share"]["converted_weight_share"],
            "unet_bytes": {name: row["unet_bytes"] for name, row in unet["bytes"].items()},
            "int8_saves_of_whole_unet": unet["bytes"]["int8"]["saved_of_whole_unet"],
            "unet_sd15_batch2": {str(side): table for side, table in unet["times"].items()},
            f"serving_{CLIENTS}_clients": served,
            "target": {"int8_converted_linear_bytes_over_fp32_at_most": MAX_LINEAR_BYTES_RATIO},
            "meets_target": int8_linear <= MAX_LINEAR_BYTES_RATIO and printed,
            "cpu_cannot_show": "float8 and nf4 (CUDA only), GPU kernels and memory bandwidth",
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
