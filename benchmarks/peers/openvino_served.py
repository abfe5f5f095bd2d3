"""Our served default against OpenVINO on the same CPU: a whole guided image, 10 steps, at 256²
and 512², through our server over HTTP beside OpenVINO running the same weights.

The folder: SD-1.5's architecture with random weights (seed 0): its UNet
(`SD.reference_configs["sd15"]`, 860M parameters), a CLIP text encoder of its size (12 layers,
768 wide; the built-in tokenizer's vocabulary), SD's VAE and SD-1.5's published PNDM schedule,
saved as diffusers saves a pipeline, safetensors.

Ours: `python -m server serve` on that folder at its defaults (`--dtype auto`, `--compile auto`,
the planner's workers and threads), with `--compile-sizes 256,512` (the default compiles the
model's native 512 only) and `--max-batch 2` (a lone image's buckets only: the default 16 rows
would compile for a quarter of an hour on 2 cores). The benchmark waits for its background
compile to end, then times `POST /v1/images/generations` end to end (PNG and base64 included).

OpenVINO: the text encoder, UNet and VAE decoder converted with `openvino.convert_model` (as
optimum-intel exports them; optimum-intel itself cannot be installed beside transformers 5, see
`benchmarks.peers.openvino_unet`), compiled for the CPU at 2 threads, one stream, LATENCY, at three
precisions: fp32, bf16 (INFERENCE_PRECISION_HINT) and int8 weights (NNCF INT8_ASYM, every
model, as optimum-intel's `load_in_8bit`) computing in bf16; on a CPU OpenVINO runs no bfloat16
on (BF16 missing from its OPTIMIZATION_CAPABILITIES: no avx512_bf16, no AMX), fp32 and int8
weights computing in fp32, OpenVINO's own choice there. The loop around them is diffusers'
(`StableDiffusionPipeline`'s: tokenize, encode the prompt and the empty prompt, the scheduler,
classifier-free guidance, decode) with the folder's own scheduler, as optimum-intel's pipeline
loads it: PNDM's 10 steps are 11 UNet calls on both sides; its image is PNG-encoded too.

Rounds are interleaved (every variant once a round at each size, the order rotating); medians.
Then the server stops and starts again on the same cache directory: how soon a restart's graphs
are ready (its frozen graphs load from their libraries, `server/engine/runtime/packages.py`).

Target (`meets_target`): our served image ≤ 1.0× OpenVINO's best at full weights (fp32 or bf16)
at 256², ≤ 1.1× at 512²; the background compile ready within 10 minutes of a cold start, and
within 60 s of a warm restart. Its int8 weights draw another image from the same folder, a
quality tier of their own, as our `--quantize int8` is: timed and given as a ratio, not a target.
Printed too: the CPU's flags (AMX or not: OpenVINO's bf16 runs on AMX tiles where present), and
what the server chose (dtype, compile mode, the buckets frozen).

    pip install -e '.[peers]' -c constraints.txt
    python -m benchmarks.peers.openvino_served [--quick] [--rounds N] [--sizes 256 512]
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import diffusers
import httpx
import numpy as np
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from PIL import Image
from transformers import CLIPTextModel

from benchmarks.peers.openvino_unet import MISSING, THREADS, TOKENS, Traced, cpu_flags
from benchmarks.serving.clients import compiled_after
from server.demo.tokenizer import build_tokenizer
from server.pipeline.families.sd import SD
from tests.support.live import live_server
from tests.support.tiny_pipelines import _text_config, save_sd_folder

STEPS = 10
GUIDANCE = 7.5
PROMPT = "a red circle"
SEED = 7
TARGETS = {256: 1.0, 512: 1.1}  # ours / OpenVINO's best at full weights, at most
COLD_READY_S = 600  # from start to the background compile's end, an empty cache directory
WARM_READY_S = 60  # ... a restart on the cache directory the first start filled
OPENVINO = {  # name: (weights, inference precision)
    "openvino_fp32": ("fp32", "f32"),
    "openvino_bf16": ("fp32", "bf16"),
    "openvino_int8_bf16": ("int8", "bf16"),
}
OPENVINO_WITHOUT_BF16 = {"openvino_fp32": ("fp32", "f32"), "openvino_int8_fp32": ("int8", "f32")}
FULL_WEIGHTS = {n for n, (weights, _) in (OPENVINO | OPENVINO_WITHOUT_BF16).items() if weights == "fp32"}
SD_VAE = {
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 512,
    "scaling_factor": 0.18215,
}


def build_folder(folder: Path) -> Path:
    """SD-1.5's architecture, random weights under seed 0 (see the module's docstring)."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    text = _text_config(tokenizer)
    text.update(
        {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
    )
    unet = UNet2DConditionModel(**SD.reference_configs["sd15"])
    return save_sd_folder(folder, AutoencoderKL(**SD_VAE), CLIPTextModel(text), tokenizer, unet)


class _Encoder(torch.nn.Module):
    def __init__(self, text: torch.nn.Module) -> None:
        super().__init__()
        self.text = text

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text(ids, return_dict=False)[0]


class _Decoder(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]


def export(folder: Path, out: Path) -> dict[str, dict[str, Path]]:
    """Each part's OpenVINO IR, fp32 and int8-weight: {"fp32": {part: path}, "int8": {...}}."""
    import nncf
    import openvino as ov

    parts = {  # each part loaded when converted: one in memory at a time
        "text_encoder": (
            lambda: _Encoder(CLIPTextModel.from_pretrained(folder / "text_encoder")),
            (torch.ones(2, TOKENS, dtype=torch.long),),
        ),
        "unet": (
            lambda: Traced(UNet2DConditionModel.from_pretrained(folder / "unet")),
            (torch.randn(2, 4, 32, 32), torch.full((2,), 500.0), torch.randn(2, TOKENS, 768)),
        ),
        "vae_decoder": (
            lambda: _Decoder(AutoencoderKL.from_pretrained(folder / "vae")),
            (torch.randn(1, 4, 32, 32),),
        ),
    }
    paths: dict[str, dict[str, Path]] = {"fp32": {}, "int8": {}}
    started = time.perf_counter()
    for name, (load, example) in parts.items():
        with torch.no_grad():
            model = ov.convert_model(load().eval(), example_input=example)
        paths["fp32"][name] = out / f"{name}_fp32.xml"
        ov.save_model(model, paths["fp32"][name], compress_to_fp16=False)
        paths["int8"][name] = out / f"{name}_int8.xml"
        ov.save_model(
            nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM), paths["int8"][name]
        )
        del model
        gc.collect()
    emit({"export": True, "seconds": round(time.perf_counter() - started, 1)})
    return paths


def openvino_variants() -> dict[str, tuple[str, str]]:
    """The precisions OpenVINO runs natively on this CPU. Its bf16 hint where it lists no BF16
    capability is no peer: emulated, it runs many times slower than fp32 (docs/benchmarks.md has
    the figures), so a user there would pick fp32 or int8."""
    import openvino as ov

    native = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return OPENVINO if "BF16" in native else OPENVINO_WITHOUT_BF16


def folder_scheduler(folder: Path) -> SchedulerMixin:
    """The scheduler the folder names, as a diffusers pipeline loads it: another class over the
    same config would run another number of UNet calls (PNDM's 10 steps are 11, DDIM's 10)."""
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    return getattr(diffusers, config["_class_name"]).from_pretrained(folder / "scheduler")


class OpenVinoImage:
    """diffusers' Stable Diffusion loop around three OpenVINO models at one precision."""

    def __init__(self, folder: Path, paths: dict[str, Path], precision: str) -> None:
        import openvino as ov

        core = ov.Core()
        config = {
            "INFERENCE_NUM_THREADS": THREADS,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": precision,
        }
        self.parts = {
            name: core.compile_model(path, "CPU", config).create_infer_request()
            for name, path in paths.items()
        }
        self.tokenizer = build_tokenizer()
        self.scheduler = folder_scheduler(folder)

    def _run(self, part: str, *inputs: np.ndarray) -> np.ndarray:
        request = self.parts[part]
        request.infer(dict(enumerate(inputs)))
        return np.array(request.get_output_tensor(0).data)

    def __call__(self, size: int) -> bytes:
        ids = self.tokenizer(
            ["", PROMPT], padding="max_length", max_length=TOKENS, truncation=True, return_tensors="np"
        ).input_ids
        context = self._run("text_encoder", ids.astype(np.int64))
        self.scheduler.set_timesteps(STEPS)
        generator = torch.Generator().manual_seed(SEED)
        latents = (
            torch.randn(1, 4, size // 8, size // 8, generator=generator) * self.scheduler.init_noise_sigma
        )
        for t in self.scheduler.timesteps:
            sample = self.scheduler.scale_model_input(torch.cat([latents, latents]), t).numpy()
            noise = torch.from_numpy(self._run("unet", sample, np.full((2,), float(t), np.float32), context))
            uncond, cond = noise.chunk(2)
            latents = self.scheduler.step(uncond + GUIDANCE * (cond - uncond), t, latents).prev_sample
        image = self._run("vae_decoder", latents.numpy())
        pixels = ((image[0].transpose(1, 2, 0) / 2 + 0.5).clip(0, 1) * 255).round().astype(np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        return png.getvalue()


def served_image(url: str) -> Callable[[int], bytes]:
    def run(size: int) -> bytes:
        body = {
            "prompt": PROMPT,
            "seed": SEED,
            "size": f"{size}x{size}",
            "num_inference_steps": STEPS,
            "guidance_scale": GUIDANCE,
        }
        answer = httpx.post(f"{url}/v1/images/generations", json=body, timeout=1800)
        answer.raise_for_status()
        return base64.b64decode(answer.json()["data"][0]["b64_json"])

    return run


def emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), flush=True)
    return record


def measure(size: int, runs: dict[str, Callable[[int], bytes]], rounds: int) -> dict[str, float]:
    """Median seconds of each variant's image at `size`, after one warm-up image each."""
    for name, run in runs.items():  # warm-up: oneDNN's primitives, OpenVINO's shape's kernels
        started = time.perf_counter()
        Image.open(io.BytesIO(run(size))).verify()
        emit({"size": size, "warmup": name, "seconds": round(time.perf_counter() - started, 2)})
    names, times = list(runs), {name: [] for name in runs}
    for turn in range(rounds):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            runs[name](size)
            times[name].append(time.perf_counter() - started)
        emit({"size": size, "round": turn, **{f"{n}_s": round(times[n][-1], 3) for n in names}})
    return {name: statistics.median(values) for name, values in times.items()}


def start_ours(stack: ExitStack, folder: Path, sizes: list[int], cache: Path) -> tuple[Any, dict[str, Any]]:
    """Our server on `folder` (kept open on `stack`), once its background compile has ended: the
    seconds to ready and to graphs ready, the compile's view and what the server chose."""
    started = time.perf_counter()
    args = ["--model", str(folder), "--compile-sizes", ",".join(map(str, sizes)), "--max-batch", "2"]
    server = stack.enter_context(live_server(*args, "--cache-dir", str(cache), startup_deadline_s=600))
    ready_s = time.perf_counter() - started
    compiled = compiled_after(server, started)
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    dtype = httpx.get(f"{server.url}/v1/stats", timeout=30).json().get("dtype")
    return server, {"ready_s": round(ready_s, 1), "compile": compiled, "dtype": dtype, "model": model}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds at 256² only")
    parser.add_argument("--rounds", type=int, help="timed rounds per size (default 3, or 5 without --quick)")
    parser.add_argument("--sizes", type=int, nargs="+", choices=sorted(TARGETS), help="image sides")
    args = parser.parse_args(argv)
    try:
        import nncf  # noqa: F401
        import openvino as ov
    except ImportError:
        raise SystemExit(MISSING) from None
    rounds = args.rounds or (3 if args.quick else 5)
    sizes = args.sizes or ([256] if args.quick else sorted(TARGETS))
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp, ExitStack() as stack:
        folder = build_folder(Path(tmp) / "sd15")
        paths = export(folder, Path(tmp))
        variants = openvino_variants()
        runs = {
            name: OpenVinoImage(folder, paths[weights], precision)
            for name, (weights, precision) in variants.items()
        }
        cache = Path(tmp) / "cache"
        server, compiled = start_ours(stack, folder, sizes, cache)
        emit({"ours": True, "start": "cold", **compiled})
        runs = {"ours_served": served_image(server.url), **runs}
        medians = {size: measure(size, runs, rounds) for size in sizes}
        stack.close()  # the server stops; the same cache directory again: a restart's graphs
        with ExitStack() as again:
            _, restarted = start_ours(again, folder, sizes, cache)
        emit({"ours": True, "start": "warm", **restarted})
    starts = {
        "compile_ready_cold_s": compiled["compile"]["ready_after_s"],
        "compile_ready_warm_s": restarted["compile"]["ready_after_s"],
        "graphs_loaded_warm": restarted["compile"]["loaded"],
        "graphs_compiled_warm": restarted["compile"]["compiled"],
        "targets_s": {"cold": COLD_READY_S, "warm": WARM_READY_S},
    }
    summary: dict[str, Any] = {}
    meets = starts["compile_ready_cold_s"] <= COLD_READY_S and starts["compile_ready_warm_s"] <= WARM_READY_S
    for size, seconds in medians.items():
        peers = {n: s for n, s in seconds.items() if n.startswith("openvino_")}
        best = min(FULL_WEIGHTS & set(peers), key=peers.get)
        ratio = seconds["ours_served"] / peers[best]
        meets = meets and ratio <= TARGETS[size]
        summary[f"image_{size}"] = {
            **{f"{n}_median_s": round(s, 3) for n, s in seconds.items()},
            "openvino_best": best,
            "ratio_to_best": round(ratio, 3),
            "ratios": {n: round(seconds["ours_served"] / s, 3) for n, s in peers.items()},
            "target": TARGETS[size],
        }
    flags = cpu_flags()
    emit(
        {
            "summary": True,
            "meets_target": meets,
            **summary,
            "starts": starts,
            "steps": STEPS,
            "rounds": rounds,
            "threads": THREADS,
            "torch": torch.__version__,
            "openvino": ov.get_version(),
            "cpu_flags": flags,
            "amx": bool(flags.get("amx_bf16")),
            "openvino_native_bf16": "openvino_bf16" in variants,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
