"""diffusers' own context parallelism (Ulysses sequence parallelism) on CPU over torch.distributed's
gloo backend, on a FLUX-shaped DiT: the yardstick for our in-process sequence split.

The model (`flux_shaped`): `FluxTransformer2DModel` built from its config, random weights under
seed 0, float32, 146M parameters: 2 double-stream (MMDiT) blocks and 4 single-stream blocks,
8 heads of 128 (inner dim 1024, MLP 4096), joint_attention_dim 1024, pooled_projection_dim 768,
in_channels 64 (patch_size 1: the transformer takes already-packed 2×2 latent patches),
guidance embedding on, RoPE axes (16, 56, 56) as FLUX.1's. Inputs (`example_inputs`, seed 1):
1024 image tokens (a 64² latent of 16 channels packed 2×2, i.e. a 512² image) and 128 text
tokens, batch 1, so every attention is over 1152 tokens; ~207 GFLOP a forward: 175 in the
Linears (FlopCounterMode), 33 in attention's two matmuls (6 × 4·1152²·1024). ~0.9 s at 2
threads on the host below.

Configurations, each a JSON line:

- `one_process`, threads 1 and 2: the plain forward in this process, `torch.set_num_threads`;
- `diffusers_ulysses2_gloo`: 2 processes (`torch.multiprocessing.spawn`, MASTER_ADDR 127.0.0.1 and
  a free port), one intra-op thread each, `dist.init_process_group("gloo")`, the same model
  (same seed), `model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))`. Its
  split hook cuts hidden_states, encoder_hidden_states, img_ids and txt_ids in half along the
  sequence; every attention does an all-to-all of Q, K, V (tokens → heads), SDPA on 4 heads over
  all 1152 tokens, an all-to-all back; `proj_out`'s hook all-gathers the output.

Each configuration is warmed up once and timed over `rounds` forwards (wall clock; in the
parallel one a barrier before each forward, and a forward's time is the slowest rank's);
medians. `max_abs_diff`: rank 0's gathered output against the one-process output of the same
model and inputs (float32; ~1e-6 expected, the sum order differs).

What diffusers 0.42.1 needs to run this on CPU (both worked around here, nothing else changed):

1. `enable_parallelism` fails on a CPU-only torch before it builds anything:
   `ModelMixin._resolve_parallel_config` computes `torch.device(device_type,
   rank % torch.accelerator.device_count())`, and `device_count()` is 0 without an accelerator:
   `ZeroDivisionError: integer modulo by zero`. The device it computes is stored and never read
   on the context-parallel path, so `device_count` is patched to 1 for that one call
   (`_cpu_enable_parallelism`); the mesh it then builds is `init_device_mesh("cpu", (1, 2))` on gloo.
2. With `return_dict=True` (the default) the root module's split hook fails after the forward:
   `ValueError: Expected output to be a tensor or a list/tuple of tensors, but got <class
   'diffusers.models.modeling_outputs.Transformer2DModelOutput'>`; diffusers' pipelines call the
   transformer with `return_dict=False`, and so does this benchmark (both sides).

Gloo itself is no obstacle: funcol's `all_to_all_single` and `all_gather_tensor` run on it. The
native backend (SDPA) is registered with `supports_context_parallel=True` and is the default, so
no backend has to be chosen. Ring attention (`ring_degree=2`) is not measured: it needs the
attention op to return its log-sum-exp, and `_native_attention_forward_op` raises
`ValueError: Native attention does not support return_lse=True`; every backend that does return
it (`flash`, `_native_flash`, `_native_cudnn`, `sage`, the hub kernels) is CUDA-only
(`aten::_scaled_dot_product_flash_attention` has no CPU kernel; CPU's
`_scaled_dot_product_flash_attention_for_cpu` is not wired to any diffusers backend).

What it measured, with its host and date, is in docs/benchmarks.md.

What a CPU run cannot show: the two ranks share the host's cores, memory and caches, so "2
processes × 1 thread" competes with "1 process × 2 threads" for the same hardware (the fair
comparison here), and gloo's all-to-all is a loopback TCP copy, not NVLink/NCCL; no overlap of
communication with compute; no GPU kernels, whose efficiency at half the sequence differs from a
CPU's. The CPU figures show the cost of the split and its collectives, not a multi-device speedup.

    python -m benchmarks.peers.diffusers_context_parallel [--quick] [--rounds N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

IMAGE_TOKENS = 1024  # a 64² latent packed 2×2 (512² image)
TEXT_TOKENS = 128
MODEL_SEED = 0
INPUT_SEED = 1
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def flux_shaped(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small FLUX.1-shaped `FluxTransformer2DModel` with random weights (seed 0), in eval mode.

    2 double-stream + 4 single-stream blocks, 8 heads × 128 (inner 1024, MLP 4096),
    joint_attention_dim 1024, pooled_projection_dim 768, in_channels 64 (patch_size 1, packed
    2×2 latent patches of 16 channels), guidance_embeds, axes_dims_rope (16, 56, 56) (sums to
    128). 146M parameters.
    """
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(MODEL_SEED)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=128,
        num_attention_heads=8,
        joint_attention_dim=1024,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.eval()


def example_inputs(
    model: torch.nn.Module, image_tokens: int = IMAGE_TOKENS, text_tokens: int = TEXT_TOKENS
) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments at batch 1, deterministic (seed 1).

    hidden_states [1, image_tokens, in_channels] (packed latent), encoder_hidden_states
    [1, text_tokens, joint_attention_dim], pooled_projections [1, pooled_projection_dim],
    timestep and guidance [1] (already divided by 1000, as FluxPipeline passes them), img_ids
    [image_tokens, 3] on a square grid as FluxPipeline builds them, txt_ids [text_tokens, 3] zeros.
    """
    config = model.config
    dtype = next(model.parameters()).dtype
    side = math.isqrt(image_tokens)
    if side * side != image_tokens:
        raise ValueError(f"image_tokens must be a square number, got {image_tokens}")
    generator = torch.Generator().manual_seed(INPUT_SEED)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    return {
        "hidden_states": torch.randn(1, image_tokens, config.in_channels, generator=generator).to(dtype),
        "encoder_hidden_states": torch.randn(
            1, text_tokens, config.joint_attention_dim, generator=generator
        ).to(dtype),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator).to(dtype),
        "timestep": torch.tensor([0.75], dtype=dtype),
        "img_ids": img_ids.reshape(image_tokens, 3).to(dtype),
        "txt_ids": torch.zeros(text_tokens, 3, dtype=dtype),
        "guidance": torch.tensor([3.5], dtype=dtype),
    }


def forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    # return_dict=False: diffusers' context-parallel split hook on the root module rejects the
    # Transformer2DModelOutput that return_dict=True gives (see the module docstring).
    with torch.inference_mode():
        output = model(**inputs, return_dict=False)[0]
    # Under context parallelism the output is proj_out's all-gather from funcol, an
    # AsyncCollectiveTensor: wait for it, as the scheduler step using it would, so that a timed
    # forward includes that last collective.
    wait = getattr(output, "wait", None)
    return wait() if callable(wait) else output


def single_process(threads: int, rounds: int = 5, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The same forward in this process with `threads` intra-op threads: median seconds over
    `rounds` after one warm-up, and the output (for the parallel runs' max_abs_diff)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = flux_shaped(dtype)
        inputs = example_inputs(model)
        output = forward(model, inputs)  # warm-up
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            forward(model, inputs)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    median = statistics.median(times) if times else None
    return {"median_s": median, "times_s": times, "output": output.float()}


@contextlib.contextmanager
def _cpu_enable_parallelism():
    """diffusers 0.42.1's `_resolve_parallel_config` takes `rank % torch.accelerator.device_count()`,
    0 on a CPU-only torch (ZeroDivisionError); the device it yields is unused by context parallelism."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda *args, **kwargs: 1):
        yield


def _rank_main(rank: int, degree: int, threads: int, rounds: int, dtype_name: str, result_dir: str) -> None:
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    torch.set_num_threads(threads)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(degree)
    dist.init_process_group("gloo", rank=rank, world_size=degree)
    try:
        model = flux_shaped(getattr(torch, dtype_name))
        inputs = example_inputs(model)
        with _cpu_enable_parallelism():
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))
        dist.barrier()
        warm = time.perf_counter()
        output = forward(model, inputs)
        warmup_s = time.perf_counter() - warm
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            forward(model, inputs)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a forward lasts until its slowest rank ends
            times.append(elapsed.item())
        if rank == 0:
            torch.save(
                {
                    "times_s": times,
                    "warmup_s": warmup_s,
                    "output": output.float(),
                    "mesh": str(model._parallel_config._mesh),
                },
                Path(result_dir) / "rank0.pt",
            )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def diffusers_context_parallel(
    degree: int = 2,
    threads: int = 1,
    rounds: int = 5,
    dtype: torch.dtype = torch.float32,
    reference: torch.Tensor | None = None,
) -> dict[str, Any]:
    """diffusers' Ulysses context parallelism over `degree` gloo processes of `threads` threads:
    median seconds a forward (slowest rank, after one warm-up) and rank 0's output against
    `reference` (the one-process output; computed here with `threads` threads when not given)."""
    import torch.multiprocessing as mp

    if reference is None:
        reference = single_process(threads, rounds=0, dtype=dtype)["output"]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dtype_name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as result_dir:
        start = time.perf_counter()
        mp.spawn(_rank_main, args=(degree, threads, rounds, dtype_name, result_dir), nprocs=degree, join=True)
        wall_s = time.perf_counter() - start
        result = torch.load(Path(result_dir) / "rank0.pt")
    return {
        "median_s": statistics.median(result["times_s"]),
        "times_s": result["times_s"],
        "warmup_s": result["warmup_s"],
        "max_abs_diff": (result["output"] - reference).abs().max().item(),
        "mesh": result["mesh"],
        "wall_s": wall_s,
    }


def cpu_flags() -> dict[str, bool]:
    try:
        flags = set()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:
        return {}
    return {flag: flag in flags for flag in CPU_FLAGS}


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _round(values: list[float]) -> list[float]:
    return [round(value, 4) for value in values]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, help="timed forwards per configuration (overrides --quick)")
    parser.add_argument("--degree", type=int, default=2, help="context-parallel processes (default 2)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    load_before = os.getloadavg()

    import diffusers

    model = flux_shaped(dtype)
    print(
        json.dumps(
            {
                "model": "FluxTransformer2DModel",
                "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                "config": {k: v for k, v in model.config.items() if not k.startswith("_")},
                "image_tokens": IMAGE_TOKENS,
                "text_tokens": TEXT_TOKENS,
                "dtype": args.dtype,
                "rounds": rounds,
                "torch": torch.__version__,
                "diffusers": diffusers.__version__,
                "cpu": cpu_model(),
                "cpu_count": os.cpu_count(),
                "cpu_flags": cpu_flags(),
            },
            default=str,
        ),
        flush=True,
    )
    del model

    medians: dict[str, float] = {}
    reference = None
    for threads in (1, 2):
        run = single_process(threads, rounds, dtype)
        reference = run["output"] if reference is None else reference
        diff = (run["output"] - reference).abs().max().item()
        medians[f"one_process_{threads}"] = run["median_s"]
        print(
            json.dumps(
                {
                    "config": "one_process",
                    "threads": threads,
                    "median_s": round(run["median_s"], 4),
                    "times_s": _round(run["times_s"]),
                    "max_abs_diff": diff,
                }
            ),
            flush=True,
        )

    name = f"diffusers_ulysses{args.degree}_gloo"
    threads_per_process = 1
    run = diffusers_context_parallel(args.degree, threads_per_process, rounds, dtype, reference)
    medians[name] = run["median_s"]
    print(
        json.dumps(
            {
                "config": name,
                "processes": args.degree,
                "threads_per_process": threads_per_process,
                "median_s": round(run["median_s"], 4),
                "times_s": _round(run["times_s"]),
                "warmup_s": round(run["warmup_s"], 3),
                "max_abs_diff": run["max_abs_diff"],
                "mesh": run["mesh"],
                "wall_s": round(run["wall_s"], 1),
            }
        ),
        flush=True,
    )

    cores = args.degree * threads_per_process
    same_cores = medians.get(f"one_process_{cores}")
    summary = {
        "summary": True,
        "medians_s": {key: round(value, 4) for key, value in medians.items()},
        # > 1: diffusers' split is faster than one process on as many cores
        f"speedup_vs_one_process_{cores}_threads": round(same_cores / medians[name], 3)
        if same_cores
        else None,
        "speedup_vs_one_process_1_thread": round(medians["one_process_1"] / medians[name], 3),
        "max_abs_diff": run["max_abs_diff"],
        "diffusers_workarounds": [
            "torch.accelerator.device_count patched to 1 during enable_parallelism "
            "(rank % device_count() is a ZeroDivisionError without an accelerator)",
            "return_dict=False (the root split hook rejects Transformer2DModelOutput)",
        ],
        "not_measured": "ring attention: the native (SDPA) backend cannot return the LSE it needs "
        "and every backend that can is CUDA-only",
        "cpu_cannot_show": "ranks share the host's cores, memory and caches; gloo all-to-all is a "
        "loopback copy, not NVLink/NCCL; no compute/communication overlap or GPU kernel behaviour",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "total_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
