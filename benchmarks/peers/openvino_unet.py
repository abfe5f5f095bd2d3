"""Our CPU UNet path against OpenVINO's, side by side: what the fastest CPU runtime does with the
same SD-1.5 UNet on the same cores.

An SD-1.5 UNet (`SD.reference_configs["sd15"]`: 860M parameters, random weights under seed 0) is
saved as safetensors into a temporary folder; both sides load those weights. OpenVINO's model is
exported from it as optimum-intel exports one, by hand: `openvino.convert_model` on the traced
UNet (spatial dims left dynamic, one model for both sizes), saved as float32, and NNCF's
`compress_weights` (INT8_ASYM, optimum-intel's 8-bit weight default) for the int8 model: it
compresses the convolutions too (all 282 weight layers), where ours converts only the Linears.
optimum-intel itself is not used: the release that resolves with transformers 5 (1.15) cannot
import optimum 2's exporters.

Timed: one UNet forward at 2 rows (one guided image), latent 32² (a 256² image) and 64² (512²),
2 threads each side (torch.set_num_threads; OpenVINO INFERENCE_NUM_THREADS=2, one stream,
LATENCY), in interleaved rounds (every variant once a round, the order rotating), medians:

    ours: fp32 (what `--dtype auto` serves on CPU today), fp32 through `torch.compile` with
          inductor's freezing (compiled per size in the warm-up, ~1.5 min a size here), bf16,
          bf16 with channels-last weights and
          input, int8-dynamic (`Quantization(INT8_DYNAMIC)`: torchao int8 weights and activations
          in the Linears) on the fp32 and on the bf16 model
    OpenVINO: fp32, bf16 (INFERENCE_PRECISION_HINT=bf16), int8 weights computing in bf16

Each variant's output is compared with ours fp32 once (max_abs_diff) so a fast wrong one shows.
Not measured: OpenVINO with static reshaped inputs, and a full 256² image at 10 steps (its UNet part is
10 × the 32² forward; the text encoder and VAE are not compared).

Memory: every variant held at once is ~16 GB at a 64² latent (three OpenVINO models, four of
ours); `--skip` leaves variants out where the host has less.

Target (`meets_target`): at both sizes our best variant within 1.25× of OpenVINO's best, and our
default (fp32) within 1.5×.

    pip install -e '.[peers]' -c constraints.txt
    python -m benchmarks.peers.openvino_unet [--quick] [--rounds N] [--sizes 32 64] [--skip VARIANT ...]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.engine.quantize import Quantization, QuantMode
from server.pipeline.families.sd import SD

ROWS = 2  # one guided image: the unconditional and the prompted row
THREADS = 2
TOKENS = 77
BEST_TARGET = 1.25
DEFAULT_TARGET = 1.5
KEEP = SD.keep_precise  # as the server quantizes a UNet: every Linear
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
OURS = (
    "ours_fp32",
    "ours_fp32_compiled",
    "ours_bf16",
    "ours_bf16_channels_last",
    "ours_int8_dynamic",
    "ours_bf16_int8_dynamic",
)
OPENVINO = ("openvino_fp32", "openvino_bf16", "openvino_int8_bf16")
MISSING = (
    "benchmarks.peers.openvino_served and openvino_unet need OpenVINO and NNCF: "
    "pip install -e '.[peers]' -c constraints.txt"
)


def cpu_flags() -> dict[str, bool]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return {flag: flag in flags for flag in CPU_FLAGS}


class Traced(torch.nn.Module):
    """The UNet with positional inputs and a tensor out: what convert_model traces."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.unet(sample, timestep, encoder_hidden_states=context, return_dict=False)[0]


def export(unet: torch.nn.Module, folder: Path) -> dict[str, Path]:
    """fp32 and int8-weight OpenVINO IR of `unet` in `folder`, as optimum-intel writes them."""
    import nncf
    import openvino as ov

    example = (torch.randn(ROWS, 4, 32, 32), torch.full((ROWS,), 500.0), torch.randn(ROWS, TOKENS, 768))
    started = time.perf_counter()
    with torch.no_grad():
        model = ov.convert_model(Traced(unet), example_input=example)
    converted = time.perf_counter() - started
    paths = {"fp32": folder / "unet_fp32.xml", "int8": folder / "unet_int8.xml"}
    ov.save_model(model, paths["fp32"], compress_to_fp16=False)
    started = time.perf_counter()
    model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    compressed = time.perf_counter() - started
    ov.save_model(model, paths["int8"], compress_to_fp16=False)
    del model
    gc.collect()
    print(json.dumps({"export": True, "convert_s": round(converted, 1), "compress_s": round(compressed, 1)}))
    return paths


def openvino_variants(paths: dict[str, Path], wanted: set[str]) -> dict[str, Any]:
    """Infer requests compiled for the CPU at 2 threads, one per OpenVINO variant."""
    import openvino as ov

    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": THREADS, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
    plans = {
        "openvino_fp32": (paths["fp32"], "f32"),
        "openvino_bf16": (paths["fp32"], "bf16"),
        "openvino_int8_bf16": (paths["int8"], "bf16"),
    }
    requests = {}
    for name, (path, precision) in plans.items():
        if name in wanted:
            compiled = core.compile_model(path, "CPU", {**config, "INFERENCE_PRECISION_HINT": precision})
            requests[name] = compiled.create_infer_request()
    return requests


def our_variants(unet: torch.nn.Module, wanted: set[str]) -> dict[str, torch.nn.Module]:
    quantization = Quantization(QuantMode.INT8_DYNAMIC, KEEP)
    models: dict[str, torch.nn.Module] = {"ours_fp32": unet}
    if wanted & {"ours_bf16", "ours_bf16_channels_last", "ours_bf16_int8_dynamic"}:
        models["ours_bf16"] = copy.deepcopy(unet).to(torch.bfloat16)
    if "ours_fp32_compiled" in wanted:
        # inductor with freezing: weights folded into the graph and prepacked for oneDNN's
        # convolutions (without it the compiled UNet ran slower than eager here); compiled for
        # each size in its warm-up forward
        import torch._inductor.config as inductor

        inductor.freezing = True
        models["ours_fp32_compiled"] = torch.compile(unet, dynamic=False)
    if "ours_int8_dynamic" in wanted:
        models["ours_int8_dynamic"] = copy.deepcopy(unet)
        quantization.apply(models["ours_int8_dynamic"])
    if "ours_bf16_int8_dynamic" in wanted:
        models["ours_bf16_int8_dynamic"] = copy.deepcopy(models["ours_bf16"])
        quantization.apply(models["ours_bf16_int8_dynamic"])
    gc.collect()
    return models


def runner(name: str, models: dict[str, torch.nn.Module], requests: dict[str, Any]) -> Callable:
    """A call running variant `name` on (sample, timestep, context): float32 tensors in, out."""
    if name in requests:
        request = requests[name]

        def run_openvino(sample, timestep, context):
            request.infer({0: sample.numpy(), 1: timestep.numpy(), 2: context.numpy()})
            return torch.from_numpy(np.array(request.get_output_tensor(0).data))

        return run_openvino
    channels_last = name == "ours_bf16_channels_last"
    model = models["ours_bf16" if channels_last else name]
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

    def run_ours(sample, timestep, context):
        sample, context = sample.to(dtype), context.to(dtype)
        if channels_last:
            sample = sample.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            return model(sample, timestep, encoder_hidden_states=context).sample.float()

    return run_ours


def layout(name: str, models: dict[str, torch.nn.Module]) -> None:
    """Put the shared bf16 model's weights in the memory format `name` runs with (untimed)."""
    if "ours_bf16" in models and name in ("ours_bf16", "ours_bf16_channels_last"):
        fmt = torch.channels_last if name == "ours_bf16_channels_last" else torch.contiguous_format
        models["ours_bf16"].to(memory_format=fmt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, help="timed rounds per size (overrides --quick)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64], help="latent sides")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=OURS[1:] + OPENVINO, help="variants left out"
    )
    args = parser.parse_args(argv)
    try:
        import nncf  # noqa: F401
        import openvino as ov
    except ImportError:
        raise SystemExit(MISSING) from None
    rounds = args.rounds or (2 if args.quick else 5)
    wanted = set(OURS + OPENVINO) - set(args.skip)
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        from diffusers import UNet2DConditionModel

        folder = Path(tmp)
        torch.manual_seed(0)
        UNet2DConditionModel(**SD.reference_configs["sd15"]).save_pretrained(
            folder / "unet", safe_serialization=True
        )
        gc.collect()
        unet = UNet2DConditionModel.from_pretrained(folder / "unet").eval()
        paths = export(unet, folder)
        requests = openvino_variants(paths, wanted)
        models = our_variants(unet, wanted)
        names = [n for n in OURS + OPENVINO if n in wanted]
        medians = {size: measure(size, names, models, requests, rounds) for size in args.sizes}
    summary = summarize(medians, args.sizes)
    print(
        json.dumps(
            {
                "summary": True,
                **summary,
                "rows": ROWS,
                "threads": THREADS,
                "rounds": rounds,
                "torch": torch.__version__,
                "openvino": ov.get_version(),
                "cpu_flags": cpu_flags(),
                "openvino_cpu_capabilities": ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"),
                "not_measured": "OpenVINO static shapes, a full 256² image at 10 steps",
            }
        )
    )
    return 0


def measure(
    size: int, names: list[str], models: dict[str, torch.nn.Module], requests: dict[str, Any], rounds: int
) -> dict[str, float]:
    """Median ms of each variant at a `size`² latent; one warm-up call each, checked against fp32."""
    generator = torch.Generator().manual_seed(size)
    inputs = (
        torch.randn(ROWS, 4, size, size, generator=generator),
        torch.full((ROWS,), 500.0),
        torch.randn(ROWS, TOKENS, 768, generator=generator),
    )
    runs = {name: runner(name, models, requests) for name in names}
    reference = None
    check = {}
    for name in names:  # warm-up: oneDNN primitives, OpenVINO's shape-specific kernels
        layout(name, models)
        started = time.perf_counter()
        out = runs[name](*inputs)
        reference = out if reference is None else reference
        check[name] = {
            "warmup_ms": round((time.perf_counter() - started) * 1e3),
            "max_abs_diff": round(float((out - reference).abs().max()), 4),
        }
    print(json.dumps({"size": size, "warmup": check}))
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            layout(name, models)
            started = time.perf_counter()
            runs[name](*inputs)
            times[name].append(time.perf_counter() - started)
        print(
            json.dumps(
                {"size": size, "round": round_, **{f"{n}_ms": round(times[n][-1] * 1e3) for n in names}}
            )
        )
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def summarize(medians: dict[int, dict[str, float]], sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    meets = True
    notes = []
    for size in sizes:
        ms = medians[size]
        ours = {n: v for n, v in ms.items() if n.startswith("ours_")}
        peers = {n: v for n, v in ms.items() if n.startswith("openvino_")}
        best_ours, best_peer = min(ours, key=ours.get), min(peers, key=peers.get)
        best_ratio = ours[best_ours] / peers[best_peer]
        default_ratio = ms["ours_fp32"] / peers[best_peer]
        meets = meets and best_ratio <= BEST_TARGET and default_ratio <= DEFAULT_TARGET
        out[f"latent_{size}"] = {
            **{f"{n}_median_ms": round(v) for n, v in ms.items()},
            "ours_best": best_ours,
            "openvino_best": best_peer,
            "best_ratio": round(best_ratio, 3),
            "default_ratio": round(default_ratio, 3),
        }
        same = {
            n.removeprefix("ours_"): round(v / peers[f"openvino_{n.removeprefix('ours_')}"], 2)
            for n, v in ours.items()
            if f"openvino_{n.removeprefix('ours_')}" in peers
        }
        notes.append(
            f"{size}²: OpenVINO's {best_peer.removeprefix('openvino_')} {peers[best_peer]:.0f} ms vs our "
            f"{best_ours.removeprefix('ours_')} {ours[best_ours]:.0f} ms ({best_ratio:.2f}×), our fp32 "
            f"{default_ratio:.2f}×; like for like ours/OpenVINO {same}"
        )
    return {
        "meets_target": meets,
        "best_target": BEST_TARGET,
        "default_target": DEFAULT_TARGET,
        **out,
        "note": "; ".join(notes),
    }


if __name__ == "__main__":
    raise SystemExit(main())
