"""ModelShard's forward overhead on an SD-1.5 UNet: unsharded vs 2 and 4 stages vs accelerate.

Every stage sits on the CPU, so all variants do the same arithmetic and the ratios isolate
the cost of the hooks around it. One JSON object per variant, then a summary, on stdout.

    python -m benchmarks.shard [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from importlib.metadata import version
from typing import Any

import torch
from torch import nn

TARGET_RATIO = 1.02
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def build_unet() -> nn.Module:
    from diffusers import UNet2DConditionModel

    from server.architectures import UNET_CONFIGS

    torch.manual_seed(0)
    return UNet2DConditionModel(**UNET_CONFIGS["sd15"]).to(torch.bfloat16).eval()


def plain(model: nn.Module) -> Forward:
    return lambda sample, t, ctx: model(sample, t, encoder_hidden_states=ctx, return_dict=False)[0]


def dispatch_with_accelerate(model: nn.Module, plan: Any) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of `model` dispatched by accelerate with `plan`'s blocks as a module-path map."""
    from accelerate import dispatch_model

    from server.engine.blocks import layout_of

    modules = {block.name: block.modules for block in layout_of(model).blocks}
    device_map = {
        path: stage.device for stage in plan.stages for block in stage.blocks for path in modules[block]
    }
    twin = dispatch_model(copy.deepcopy(model), device_map=device_map, force_hooks=True)
    # With only "cpu" in the map, accelerate picks cpu as main device and offloads only "disk"
    # entries: nothing goes to meta, it just hooks the map's modules and every submodule with state.
    meta = sum(p.is_meta for p in twin.parameters())
    hooks = sum(hasattr(m, "_hf_hook") for m in twin.modules())
    note = (
        f"dispatch_model(force_hooks=True), {len(device_map)} map entries all 'cpu': main device cpu, "
        f"{meta} parameters offloaded to meta (its 'offloaded to the cpu' log line notwithstanding); "
        f"AlignDevicesHook on {hooks} modules, the same hooks a multi-GPU map gets"
    )
    return twin, {"hooks": hooks, "offloaded_params": meta, "note": note}


def time_once(make: Callable[[], AbstractContextManager[Forward]], inputs: Any) -> tuple[float, torch.Tensor]:
    # Build inside the timer's `with` but outside the clock: ModelShard's hooks live only here.
    with make() as forward:
        start = time.perf_counter()
        out = forward(inputs.sample, inputs.timestep, inputs.context)
        return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds at latent 16 (a smoke test)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 7, or 2 with --quick)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 7)
    latent, batch, dtype = (16 if args.quick else 32), 2, torch.bfloat16

    from server.engine import ModelShard, plan_shards
    from server.engine.blocks import UNetSpec

    model = build_unet()
    inputs = UNetSpec().example_inputs(model, batch, latent, dtype, torch.device("cpu"))
    plans = {
        n: plan_shards(model, ",".join(["cpu"] * n), "even", dtype=dtype, latent_size=latent, batch=batch)
        for n in (2, 4)
    }
    twin, accel_info = dispatch_with_accelerate(model, plans[4])
    modules = {block.name: block.modules for block in UNetSpec().layout(model).blocks}
    variants: dict[str, Callable[[], AbstractContextManager[Forward]]] = {
        "unsharded": lambda: nullcontext(plain(model)),
        "modelshard_2": lambda: ModelShard(model, plans[2]),
        "modelshard_4": lambda: ModelShard(model, plans[4]),
        "accelerate_dispatch": lambda: nullcontext(plain(twin)),
    }
    extra: dict[str, dict[str, Any]] = {
        f"modelshard_{n}": {
            "stages": [list(s.blocks) for s in plan.stages],
            "hooks": sum(len(modules[b]) for s in plan.stages[1:] for b in s.blocks),
        }
        for n, plan in plans.items()
    }
    extra["accelerate_dispatch"] = accel_info

    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        # Warm up once per variant, and check its output against the plain forward.
        outs = {name: time_once(make, inputs)[1] for name, make in variants.items()}
        ref = outs["unsharded"]
        matches = {
            name: torch.allclose(out, ref, rtol=1e-2, atol=1e-2)
            if name.startswith("accelerate")
            else torch.equal(out, ref)
            for name, out in outs.items()
        }
        names = list(variants)
        for r in range(rounds):  # rotate the order each round so drift hits every variant alike
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(time_once(variants[name], inputs)[0])

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = {name: medians[name] / medians["unsharded"] for name in variants}
    for name in variants:
        row = {
            "variant": name,
            "median_s": round(medians[name], 4),
            "min_s": round(min(times[name]), 4),
            "runs": len(times[name]),
            "ratio_vs_unsharded": round(ratios[name], 4),
            "matches": matches[name],
            "times_s": [round(t, 4) for t in times[name]],
            **extra.get(name, {}),
        }
        print(json.dumps(row), flush=True)
    worst = max(ratios["modelshard_2"], ratios["modelshard_4"])
    summary = {
        "summary": True,
        "ratio_2_stages": round(ratios["modelshard_2"], 4),
        "ratio_4_stages": round(ratios["modelshard_4"], 4),
        "ratio_accelerate": round(ratios["accelerate_dispatch"], 4),
        "target_ratio": TARGET_RATIO,
        "meets_target": worst <= TARGET_RATIO,
        "config": {
            "model": "sd15 (random weights, seed 0)",
            "dtype": str(dtype).removeprefix("torch."),
            "latent_size": latent,
            "batch": batch,
            "rounds": rounds,
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "diffusers": version("diffusers"),
            "accelerate": version("accelerate"),
        },
    }
    print(json.dumps(summary), flush=True)

    print(f"\n{'variant':<20} {'median s':>9} {'min s':>8} {'ratio':>7}  matches", file=sys.stderr)
    for name, ts in times.items():
        line = f"{name:<20} {medians[name]:>9.3f} {min(ts):>8.3f} {ratios[name]:>7.3f}  {matches[name]}"
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
