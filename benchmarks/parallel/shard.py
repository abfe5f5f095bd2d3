"""ModelShard's forward overhead: unsharded vs 2 and 4 stages vs accelerate's dispatch_model.

An SD-1.5 UNet (random weights), bf16, latent 32x32, batch 2, every stage on the CPU: all
variants do the same arithmetic, so what differs is the machinery around it. Two figures:

- wall-clock ratio to the unsharded forward. A forward takes ~1 s and varies 5-10% from
  run to run on a shared machine, so each variant is paired with the unsharded run of the
  same round, and the median and quartiles of those ratios are reported;
- time spent inside the hooks themselves per forward (ModelShard's transfer hooks,
  accelerate's pre/post-forward hooks), measured by wrapping each hook in a timer: a
  precise figure for the cost that the noisy wall clock cannot resolve.

One JSON object per variant, then a summary, on stdout.

    python -m benchmarks.parallel.shard [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from importlib.metadata import version
from typing import Any

import torch
from diffusers import UNet2DConditionModel
from torch import nn

from server.engine import ModelShard, ShardPlan, layout_of, plan_shards
from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.denoisers.unet import UNetSpec
from server.engine.hardware.memory import retain_freed_host_memory
from server.pipeline.families.sd import SD

TARGET_RATIO = 1.02
Forward = Callable[[DenoiserInputs], torch.Tensor]
Variant = Callable[[], AbstractContextManager[Forward]]


def build_unet(config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = UNet2DConditionModel(**config)
    return nn.Module.to(model, dtype).eval()  # random weights: nothing to keep in float32


def plain(model: nn.Module) -> Forward:
    return lambda x: model(x.sample, x.timestep, encoder_hidden_states=x.context, return_dict=False)[0]


@contextmanager
def sharded(model: nn.Module, plan: ShardPlan) -> Iterator[Forward]:
    shard = ModelShard(model, plan)
    yield lambda x: shard(x.sample, x.timestep, x.context)


def dispatched(model: nn.Module, plan: ShardPlan) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of `model` dispatched by accelerate with `plan`'s blocks as a module-path map."""
    from accelerate import dispatch_model

    modules = {block.name: block.modules for block in layout_of(model).blocks}
    device_map = {path: s.device for s in plan.stages for block in s.blocks for path in modules[block]}
    twin = dispatch_model(copy.deepcopy(model), device_map=device_map, force_hooks=True)
    # With only "cpu" in the map accelerate takes cpu as main device and offloads nothing
    # (only "disk" entries are offloaded), despite its "offloaded to the cpu" log line; it hooks
    # every module with state, as it does for a multi-GPU map.
    hooks = sum(hasattr(m, "_hf_hook") for m in twin.modules())
    offloaded = sum(p.is_meta for p in twin.parameters())
    return twin, {"hooks": hooks, "offloaded_params": offloaded}


def measure(model: nn.Module, inputs: DenoiserInputs, rounds: int) -> list[dict[str, Any]]:
    """Time every variant once per round, in rotated order; pair each with that round's unsharded."""
    plans = {n: plan_shards(model, ["cpu"] * n, "even", latent_size=inputs.sample.shape[-1]) for n in (2, 4)}
    twin, accelerate_info = dispatched(model, plans[4])
    owners = {"accelerate_dispatch": twin}
    variants: dict[str, Variant] = {
        "unsharded": lambda: nullcontext(plain(model)),
        "modelshard_2": lambda: sharded(model, plans[2]),
        "modelshard_4": lambda: sharded(model, plans[4]),
        "accelerate_dispatch": lambda: nullcontext(plain(twin)),
    }
    info: dict[str, dict[str, Any]] = {
        f"modelshard_{n}": {"stages": len(plan.stages), "hooks": _hooks(model, plan)}
        for n, plan in plans.items()
    }
    info["accelerate_dispatch"] = accelerate_info

    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        outs = {name: _time_once(make, inputs)[1] for name, make in variants.items()}  # warm-up
        names = list(variants)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(_time_once(variants[name], inputs)[0])
        in_hooks = {
            name: time_in_hooks(owners.get(name, model), make, inputs, repeats=3)
            for name, make in variants.items()
        }

    base = times["unsharded"]
    rows = []
    for name, ts in times.items():
        ratios = sorted(t / u for t, u in zip(ts, base, strict=True))
        rows.append(
            {
                "variant": name,
                "median_s": round(statistics.median(ts), 5),
                "min_s": round(min(ts), 5),
                "runs": len(ts),
                "ratio_vs_unsharded": round(statistics.median(ratios), 4),  # median of paired ratios
                "ratio_iqr": [round(q, 4) for q in _quartiles(ratios)],
                "hook_ms_per_forward": round(in_hooks[name][0] * 1e3, 3),
                "hook_calls_per_forward": in_hooks[name][1],
                "matches": _matches(name, outs[name], outs["unsharded"]),
                **info.get(name, {}),
            }
        )
    return rows


def _time_once(make: Variant, inputs: DenoiserInputs) -> tuple[float, torch.Tensor]:
    with make() as forward:  # ModelShard's hooks are built and removed outside the clock
        start = time.perf_counter()
        out = forward(inputs)
        return time.perf_counter() - start, out


def time_in_hooks(model: nn.Module, make: Variant, inputs: DenoiserInputs, repeats: int) -> tuple[float, int]:
    """Seconds per forward spent inside hook bodies, and hook calls per forward."""
    spent, calls = [0.0], [0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
                calls[0] += 1

        return wrapper

    with make() as forward:
        undo: list[Callable[[], None]] = []
        for module in model.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):  # ModelShard's
                for key, fn in list(hooks.items()):
                    hooks[key] = timed(fn)
                    undo.append(lambda hooks=hooks, key=key, fn=fn: hooks.__setitem__(key, fn))
            hook = getattr(module, "_hf_hook", None)  # accelerate's
            if hook is not None:
                for name in ("pre_forward", "post_forward"):
                    setattr(hook, name, timed(getattr(hook, name)))
                    undo.append(lambda hook=hook, name=name: delattr(hook, name))
        try:
            for _ in range(repeats):
                forward(inputs)
        finally:
            for restore in undo:
                restore()
    return spent[0] / repeats, calls[0] // repeats


def _hooks(model: nn.Module, plan: ShardPlan) -> int:
    modules = {block.name: block.modules for block in layout_of(model).blocks}
    return sum(len(modules[b]) for stage in plan.stages[1:] for b in stage.blocks)


def _matches(name: str, out: torch.Tensor, ref: torch.Tensor) -> bool:
    if name.startswith("accelerate"):  # its own forward path; same math, compared loosely
        return torch.allclose(out, ref, rtol=1e-2, atol=1e-2)
    return torch.equal(out, ref)


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds at latent 16: a smoke test")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 15, 3 with --quick)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    latent, batch, dtype = (16 if args.quick else 32), 2, torch.bfloat16
    retained = retain_freed_host_memory()  # the same for every variant; halves run-to-run noise

    model = build_unet(SD.reference_configs["sd15"], dtype)
    inputs = UNetSpec().example_inputs(model, batch, latent, dtype, torch.device("cpu"))
    rows = measure(model, inputs, rounds)
    for row in rows:
        print(json.dumps(row), flush=True)

    by_name = {row["variant"]: row for row in rows}
    forward_ms = by_name["unsharded"]["median_s"] * 1e3
    share = {name: round(row["hook_ms_per_forward"] / forward_ms, 5) for name, row in by_name.items()}
    wall = {n: by_name[f"modelshard_{n}"]["ratio_vs_unsharded"] for n in (2, 4)}
    summary = {
        "summary": True,
        "ratio_2_stages": wall[2],
        "ratio_4_stages": wall[4],
        "ratio_accelerate": by_name["accelerate_dispatch"]["ratio_vs_unsharded"],
        "target_ratio": TARGET_RATIO,
        # The wall-clock ratios carry the machine's noise; the hooks' measured share is the overhead.
        "hook_share_of_forward": share,
        "meets_target": max(share["modelshard_2"], share["modelshard_4"]) <= TARGET_RATIO - 1,
        "wall_ratios_within_target": max(wall.values()) <= TARGET_RATIO,
        "config": {
            "model": "sd15 (random weights, seed 0)",
            "dtype": "bfloat16",
            "latent_size": latent,
            "batch": batch,
            "rounds": rounds,
            "threads": torch.get_num_threads(),
            "retain_freed_host_memory": retained,
            "torch": torch.__version__,
            "diffusers": version("diffusers"),
            "accelerate": version("accelerate"),
        },
    }
    print(json.dumps(summary), flush=True)

    print(
        f"\n{'variant':<20} {'median':>9} {'ratio':>6} {'IQR':>13} {'hooks ms':>9} {'calls':>6}",
        file=sys.stderr,
    )
    for r in rows:
        iqr = f"{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}"
        print(
            f"{r['variant']:<20} {r['median_s']:>8.4f}s {r['ratio_vs_unsharded']:>6.3f} {iqr:>13} "
            f"{r['hook_ms_per_forward']:>9.3f} {r['hook_calls_per_forward']:>6}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
