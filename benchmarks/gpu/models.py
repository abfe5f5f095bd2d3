"""The GPU check's real-shape benchmarks: published denoisers with random weights made on the device.

Each model is built on the meta device from its published config, given storage on the device
(`to_empty`) and filled there: never a weight on the CPU. Then, in bfloat16, in this order (a
phase cut short keeps what finished):
1. a lone step (the family's rows: 2 under guidance, FLUX.1-dev's 1) through our ModelShard
   against diffusers' own forward, in paired rounds: the median of the ratios, and the outputs'
   relative difference;
2. step batching: rows/s at each row count;
3. first-block caching: a call whose rows reuse their kept features against a full one;
4. memory three ways: our shard's reading (what /v1/shards and the metrics show),
   `torch.cuda.max_memory_allocated`, `nvidia-smi`;
5. float8 (torchao, per row, as `--quantize float8`) against bfloat16: step time, held bytes,
   relative difference. On the CPU, int8-dynamic stands in (float8 needs a GPU's tensor cores).
`--compile`: `--compile blocks` against eager at the lone rows, with the compile's seconds.

    python -m benchmarks.gpu.models sdxl flux wan [--compile] --device cuda --lines FILE
"""

from __future__ import annotations

import gc
import inspect
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel, WanTransformer3DModel
from torch import nn

from benchmarks.gpu import Lines, phase_parser
from server.engine import CallPlan, ModelShard, plan_shards, spec_for
from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.quantize import Quantization, QuantMode, refusal
from server.engine.runtime.call import CacheAsk, RowGroup
from server.pipeline.families.flux import Flux
from server.pipeline.families.sdxl import SDXL
from server.pipeline.families.wan import WAN_1_3B, Wan
from tests.reference import diffusers_forward

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    """A published denoiser at a size people serve it, and a tiny twin for the CPU dry run."""

    cls: type[nn.Module]
    config: dict[str, Any]
    latent: tuple[int, ...]  # (h, w) or Wan's (frames, h, w)
    rows: tuple[int, ...]  # the batching sweep
    lone: int  # a lone request's rows
    keep_precise: tuple[str, ...]
    what: str


SHAPES = {
    "sdxl": Shape(
        UNet2DConditionModel, SDXL.reference_configs["sdxl"], latent=(128, 128), rows=(1, 4, 8, 16),
        lone=2, keep_precise=(), what="SDXL's UNet (2.6 B) at 1024x1024, guided",
    ),
    "flux": Shape(
        FluxTransformer2DModel, Flux.reference_configs["flux-dev"], latent=(128, 128), rows=(1, 4, 8, 16),
        lone=1, keep_precise=Flux.keep_precise, what="FLUX.1-dev's transformer (11.9 B) at 1024x1024",
    ),
    "wan": Shape(
        WanTransformer3DModel, WAN_1_3B, latent=(21, 60, 104), rows=(1, 2, 4), lone=2,
        keep_precise=Wan.keep_precise,
        what="Wan 2.1 1.3B's transformer at 832x480, 81 frames, guided (rows of 32760 tokens: 4 at most)",
    ),
}  # fmt: skip
# the dry run's: shaped like the tests' tiny models (tests/conftest.py, tests/tiny_pipelines.py)
TINY = {
    "sdxl": Shape(
        UNet2DConditionModel,
        dict(
            block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1,
            transformer_layers_per_block=(1, 2), cross_attention_dim=32, attention_head_dim=(2, 4),
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=32 + 6 * 8,
        ),
        latent=(16, 16), rows=(1, 2), lone=2, keep_precise=(), what="a tiny SDXL-shaped UNet",
    ),
    "flux": Shape(
        FluxTransformer2DModel,
        dict(
            in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=[4, 4, 8],
        ),
        latent=(16, 16), rows=(1, 2), lone=1, keep_precise=Flux.keep_precise,
        what="a tiny FLUX.1-shaped transformer",
    ),
    "wan": Shape(
        WanTransformer3DModel,
        dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ),
        latent=(3, 8, 12), rows=(1, 2), lone=2, keep_precise=Wan.keep_precise,
        what="a tiny Wan 2.1-shaped transformer",
    ),
}  # fmt: skip
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def build_on_device(shape: Shape, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model from its config on `meta`, given storage on `device` and filled there: weights
    N(0, 0.02), norms 1 and biases 0; diffusers' `_keep_in_fp32_modules` in float32, as its
    loader keeps them. Buffers computed at construction (Wan's rotary tables) are made again on
    `device` by the module's own constructor, from the arguments it keeps as attributes."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Module.to(shape.cls(**shape.config), dtype)  # diffusers' .to warns of fp32 parts
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, module in model.named_modules():
        if any(part in keep for part in name.split(".")):
            module.to(torch.float32)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, NORMS) or name == "bias":
                    param.fill_(1.0 if name == "weight" and isinstance(module, NORMS) else 0.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            if any(True for _ in child.buffers(recurse=False)):
                setattr(parent, child_name, _rebuilt(child, device))
    return model.eval()


def _rebuilt(module: nn.Module, device: torch.device) -> nn.Module:
    signature = inspect.signature(type(module).__init__)
    kwargs = {}
    for name, param in list(signature.parameters.items())[1:]:
        if hasattr(module, name):
            kwargs[name] = getattr(module, name)
        elif param.default is inspect.Parameter.empty:
            raise ValueError(f"cannot rebuild {type(module).__name__}'s buffers: it keeps no {name!r}")
    with torch.device(device):
        return type(module)(**kwargs)


def inputs_for(
    model: nn.Module, shape: Shape, rows: int, dtype: torch.dtype, device: torch.device
) -> DenoiserInputs:
    spec = spec_for(model)
    inputs = spec.example_inputs(model, rows, shape.latent[-1], dtype, device)
    if len(shape.latent) == 3:  # a video: (frames, h, w), not square
        sample = torch.randn(rows, model.config.in_channels, *shape.latent, dtype=dtype, device=device)
        inputs = replace(inputs, sample=sample)
    return inputs


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


def paired(clock: Clock, first: Callable, second: Callable, rounds: int) -> dict[str, Any]:
    """Both 3 times to warm (the GPU's clocks, cuDNN's choices), then `rounds` rounds in
    alternating order: medians and the median of paired ratios."""
    for _ in range(3):
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
    dtype = torch.bfloat16
    clock = Clock(device)
    built_s, model = clock(lambda: build_on_device(shape, dtype, device))
    shard = ModelShard(model, plan_shards(model, [str(device)], "even", latent_size=shape.latent[-1]))
    lone = inputs_for(model, shape, shape.lone, dtype, device)
    params = sum(p.numel() for p in model.parameters())
    lines.write(
        {"model": name, "what": shape.what, "params_b": round(params / 1e9, 3), "built_s": round(built_s, 1)}
    )

    # 1. a lone step: ours against diffusers' own forward
    ours = lambda: shard.run(lone, CallPlan.plain(shape.lone)).out  # noqa: E731
    theirs = lambda: diffusers_forward(model, lone)  # noqa: E731
    timing = paired(clock, ours, theirs, rounds)
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

    # 3. first-block caching: a refresh keeps the features, a reuse skips the deep blocks
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
    mode = QuantMode.FLOAT8 if device.type == "cuda" else QuantMode.INT8_DYNAMIC
    if problem := refusal(mode, str(device)):
        lines.write({"model": name, "measure": "quantized", "refused": problem})
        quantized = None
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

    peak_gib = f"{peak / GiB:.1f} GiB peak" if peak else "peak n/a"
    best = max(per_rows, key=per_rows.__getitem__)
    lines.write(
        {
            "headline": f"{name}: lone {shape.lone} rows {timing['a_ms']:.1f} ms "
            f"({timing['ratio']:.3f}x diffusers); "
            f"{per_rows[best]:.1f} rows/s at {best}; cache {cached['ratio']:.2f}x; "
            + (f"{quantized['mode']} {quantized['ratio']:.2f}x; " if quantized else "")
            + peak_gib
        }
    )


def bench_compiled(name: str, shape: Shape, device: torch.device, rounds: int, lines: Lines) -> None:
    """`--compile blocks` (inductor, per block kind) against eager at the lone rows, on the route
    `auto` takes here (jit on a PyTorch without `aot_compile`)."""
    from server.engine.runtime.compile import CompileMode
    from server.engine.runtime.graphs import CompileStats, GraphStore

    dtype, clock = torch.bfloat16, Clock(device)
    model = build_on_device(shape, dtype, device)
    shard = ModelShard(model, plan_shards(model, [str(device)], "even", latent_size=shape.latent[-1]))
    lone = inputs_for(model, shape, shape.lone, dtype, device)
    eager = shard.run(lone, CallPlan.plain(shape.lone)).out
    stats = CompileStats(CompileMode.BLOCKS.value)
    shard.compile(CompileMode.BLOCKS, GraphStore(None, [device], stats))
    compile_s, _ = clock(lambda: shard.warm(lone, shape.lone))
    compiled_plan, eager_plan = (
        CallPlan.plain(shape.lone),
        replace(CallPlan.plain(shape.lone), compiled=False),
    )
    timing = paired(
        clock, lambda: shard.run(lone, compiled_plan).out, lambda: shard.run(lone, eager_plan).out, rounds
    )
    difference = relative(shard.run(lone, compiled_plan).out, eager)
    lines.write(
        {
            "model": name,
            "measure": "compile_blocks",
            "route": stats.route,
            "compile_s": round(compile_s, 1),
            "compiled_ms": timing["a_ms"],
            "eager_ms": timing["b_ms"],
            "ratio": timing["ratio"],
            "calls": dict(stats.calls),
            "relative_difference": round(difference, 5),
        }
    )
    ratio, route = timing["ratio"], stats.route
    lines.write({"headline": f"{name} compiled ({route}) {ratio:.3f}x eager ({compile_s:.0f} s to compile)"})


def main() -> None:
    parser = phase_parser(__doc__)
    parser.add_argument("models", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--compile", action="store_true", help="compiled against eager, instead")
    args = parser.parse_args()
    lines = Lines(args.lines)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    shapes = TINY if args.quick else SHAPES
    rounds = 2 if args.quick else 5
    for name in args.models:
        (bench_compiled if args.compile else bench)(name, shapes[name], device, rounds, lines)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


if __name__ == "__main__":
    main()
    gc.freeze()  # exit skips sweeping every module's objects (~1.5 s a phase)
