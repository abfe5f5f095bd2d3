"""Plan a model's split before loading it: `serve` and `plan` both call `plan_model`, so the plan
a user prints is the plan the server runs.

The activation reserve is sized for the largest work the service admits (`batch` rows at the
largest allowed image side), and the text encoders' and VAE's bytes count against the budget
of the device they will sit on (the first stage's).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server.engine import CostModel, Costs, Parallel, ParallelPlan, layout_of, plan_parallel, plan_shards
from server.engine.denoisers.blocks import tensor_bytes
from server.engine.hardware.devices import (
    device_kind,
    parse_memory_map,
    resolve_devices,
    separate_memories,
    worker_names,
)
from server.engine.planning.cache import lookup, store
from server.engine.planning.costs import peer_access, profile_note
from server.engine.planning.plan import count_block_bytes
from server.engine.planning.sequence import HOST_STAGED_GB_S
from server.engine.quantize import Quantization, QuantMode, refusal
from server.errors import PlanError
from server.pipeline.families import Family, meta_denoiser, reference_parts
from server.pipeline.loading.folder import class_of, gguf_tensor_bytes, part_bytes
from server.pipeline.loading.quantized_parts import (
    QuantizeSetting,
    folder_quantizations,
    meta_part,
    parse_quantize,
    part_quantizations,
    quantized_bytes,
)


def largest_side(family: Family, max_pixels: int) -> int:
    """The largest square image side a request may ask for under `max_pixels`."""
    multiple = family.size_multiple
    side = max(multiple, math.isqrt(max_pixels) // multiple * multiple)
    return min(side, family.max_size) if family.max_size else side


def plan_model(
    family: Family,
    devices: str | Sequence[str],
    strategy: str,
    *,
    dtype: torch.dtype,
    batch: int,
    side: int,
    max_memory: Mapping[str, int] | str | None = None,
    device_map: Mapping[str, str] | None = None,
    folder: Path | None = None,
    parallel: str = "auto",
    threads: int = 1,
    pick_threads: bool = True,
    costs: str = Costs.COUNTED,
    cache_dir: Path | None = None,
    device_profile: str | None = None,
    quantize: QuantizeSetting | None = None,
    denoiser_file: Path | None = None,
    layout: str | None = None,
    controlnets: Mapping[str, Path] | None = None,
) -> ParallelPlan:
    """The plan for `family`'s denoiser (built on the meta device) over `devices`, reserving
    activations for `batch` rows of `side`² images; its encoders and VAE (the folder's, or a
    reference architecture's published ones) count on the first stage's device. `parallel`
    chooses replicas, pipelined stages or both (`server.engine.plan_parallel`) from block costs
    `costs` (counted or measured, at 2 rows of the native size: the typical request; measured
    ones and calibrations kept in `cache_dir`; GPUs this host lacks predicted from
    `device_profile`'s published peaks, said in the plan); `threads` is the CPU's intra-op
    threads in all (a lone CPU worker runs the count predicted fastest up to it, or all of them
    without `pick_threads`). Weights count as `quantize` (`--quantize`) leaves them, the
    denoiser's as `denoiser_file` (GGUF) holds them; `controlnets`' folders (`--controlnet`) count
    beside the encoders, where the Pipeline runs them."""
    tensor = parallel == Parallel.TENSOR or (layout is not None and not layout.endswith("x1"))
    if tensor and (QuantMode.NF4 in (quantize or {}).values() or denoiser_file):  # bitsandbytes' layers
        raise PlanError(
            "a tensor group quantizes each rank's share with torchao (int8, int8-dynamic, float8): "
            "nf4 and GGUF files are not split"
        )
    sizes, quantizations = resident_bytes(family, folder, dtype, quantize or {})
    for path in (controlnets or {}).values():  # held in the denoiser's dtype
        sizes[f"controlnet {path}"] = part_bytes(path.parent, (path.name,), dtype)
    resident = sum(sizes.values())
    # the largest text encoder is spread over a tensor group's ranks, the others kept whole (parts.py)
    spread = max((n for name, n in sizes.items() if name in family.text_encoders), default=0)
    model = meta_denoiser(family)
    block_bytes = None
    if denoiser_file is not None:
        block_bytes = gguf_block_bytes(denoiser_file, model, dtype)
    elif quantization := quantizations.get(family.denoiser):
        block_bytes = count_block_bytes(model, layout_of(model), dtype, quantization)
    latent = family.native_size // family.vae_scale_factor  # the typical request

    apart = peer_access(resolve_devices(devices))
    model_costs = CostModel(model, 2, latent, dtype, Costs(costs), cache_dir, device_profile, not apart)
    where = f"{costs} at 2 rows of {latent}² latents"
    if note := profile_note(resolve_devices(devices), device_profile, dtype):
        where += f"; {note}"
    if apart:
        where += (
            f"; no peer access between {' and '.join(apart[0])}{' (and others)' if len(apart) > 1 else ''}: "
            f"copies between GPUs go through the host, predicted at {HOST_STAGED_GB_S:g} GB/s at best"
        )
    elif len({d for d in resolve_devices(devices) if d.startswith("cuda")}) > 1:
        where += "; copies between GPUs use peer access (P2P): without it they go through the host"

    def plan(devices: str | Sequence[str], parallel: str, **more: Any) -> ParallelPlan:
        return plan_parallel(
            model,
            devices,
            parallel,
            strategy,
            threads=threads,
            block_costs=model_costs.costs,
            costs_note=where,
            pick_threads=pick_threads,
            timed=costs == Costs.MEASURED,
            lone_rows=family.lone_rows,
            links=model_costs.link,
            device_map=device_map,
            dtype=dtype,
            latent_size=side // family.vae_scale_factor,
            batch=batch,
            block_bytes=block_bytes,
            layout=layout,
            spread=spread,
            **{"max_memory": max_memory, "resident": resident, "experts": len(family.experts), **more},
        )

    # auto: experts apart on distinct GPUs, where each device's memory is its own (CPU workers share
    # the cores and one copy of the weights: replicas of both experts serve them better)
    listed, asked = resolve_devices(devices), parallel == Parallel.EXPERTS
    tried = asked or (
        parallel == Parallel.AUTO and separate_memories(listed) and not device_map and layout is None
    )
    if tried and (apart := experts_apart(family, listed, max_memory, plan, asked)):
        return apart
    return plan(devices, "off" if device_map else parallel)  # an explicit block map is one split


def experts_apart(
    family: Family,
    devices: list[str],
    max_memory: Mapping[str, int] | str | None,
    plan: Callable[..., ParallelPlan],
    asked: bool,
) -> ParallelPlan | None:
    """A model's experts (Wan 2.2 A14B's two) each on its own share of the devices, in order (the
    first with the encoders and VAE): a step's call for each runs where that expert lives, no
    activations cross between devices, and each device holds one expert's bytes. None where the
    devices do not divide among the experts or an expert does not fit its share, unless `asked`
    (`--parallel experts`): then that is the error."""
    count = len(family.experts)
    if count < 2 or len(devices) < count or len(devices) % count:
        if asked:
            raise PlanError(
                f"--parallel experts places each of a model's experts on its own devices: this model has "
                f"{count} expert(s) and {len(devices)} device(s) (give a multiple of {count}, two or more)"
            )
        return None
    share, budgets = len(devices) // count, parse_memory_map(max_memory)
    plans = []
    try:
        for k in range(count):
            mine = devices[k * share : (k + 1) * share]
            memory = {d: b for d, b in budgets.items() if d in mine}
            plans.append(plan(mine, "off", max_memory=memory, experts=1, **({"resident": 0} if k else {})))
    except PlanError:
        if asked:
            raise
        return None
    first = plans[0]
    return replace(
        first,
        replicas=tuple(p.replicas[0] for p in plans),
        workers=tuple(worker_names([s.device for p in plans for s in p.replicas[0].stages])),
        candidates=(),
        reason=f"{count} experts, each on its own device(s): a step's call per expert runs where it "
        "lives and no activations cross devices",
        experts_apart=True,
    )


def resident_bytes(
    family: Family, folder: Path | None, dtype: torch.dtype, setting: QuantizeSetting
) -> tuple[dict[str, int], dict[str, Quantization]]:
    """Bytes of each text (and image) encoder and the VAE (the folder's, or a reference
    architecture's, none for most), which sit with the first stage (see Pipeline), quantized as
    `setting` says; and the quantization of every part."""
    if folder is None:
        parts = reference_parts(family)
        encoders = {n: tensor_bytes(m, dtype) for n, m in parts.items() if n in family.text_encoders}
        quantizations = part_quantizations(setting, family, encoders)
        held = {n: family.held_dtype(n, dtype) for n in parts}
        return {n: quantized_bytes(m, quantizations.get(n), held[n]) for n, m in parts.items()}, quantizations
    index = family.config.index
    quantizations = folder_quantizations(setting, family, folder, dtype)
    sizes = {}
    encoders = (*family.text_encoders, *family.image_encoders)
    for name in ("vae", *(n for n in encoders if index.get(n) and index[n][0] is not None)):
        if quantization := quantizations.get(name):
            sizes[name] = quantized_bytes(meta_part(folder, name, class_of(index, name)), quantization, dtype)
        else:
            sizes[name] = part_bytes(folder, (name,), family.held_dtype(name, dtype))
    return sizes, quantizations


def gguf_block_bytes(file: Path, model: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """What each block holds loaded from a GGUF file, read from its header: the tensors named as
    the block's modules (diffusers' names); a file in another naming scales the blocks' bytes by
    the file's share of the model's."""
    layout = layout_of(model)
    held = count_block_bytes(model, layout, dtype)
    sizes = gguf_tensor_bytes(file)
    found = dict.fromkeys(layout.names, 0)
    for block in layout.blocks:
        for path in block.modules:
            found[block.name] += sum(n for name, n in sizes.items() if name.startswith(f"{path}."))
    if sum(found.values()) >= 0.9 * sum(sizes.values()):
        return found
    share = sum(sizes.values()) / max(1, sum(held.values()))
    return {name: round(nbytes * share) for name, nbytes in held.items()}


KNEE_GAIN = 1.1  # doubling a step's rows must raise rows/s by 10% to be worth its latency


def step_knees(
    family: Family,
    dtype: torch.dtype,
    device: str,
    threads: int,
    sides: Sequence[int],
    max_rows: int,
    cache_dir: Path | None = None,
) -> dict[int, int]:
    """Per image side, the rows of a step past which doubling them raises the predicted rows/s
    (counted costs, the planner's) by less than `KNEE_GAIN`: where batching stops paying."""
    model = meta_denoiser(family)
    key = {  # counting a model's work takes ~0.3 s a size: every start would pay it
        "knees": dict(model.config),
        "dtype": str(dtype),
        "device": device_kind(device),
        "threads": threads,
        "sides": list(sides),
        "max_rows": max_rows,
        "gain": KNEE_GAIN,
    }
    key = json.loads(json.dumps(key, default=str))  # as read back: tuples are lists
    path = cache_dir / "knees.json" if cache_dir is not None else None
    if (known := lookup(path, key)) is not None:
        return {int(side): int(knee) for side, knee in known.items()}
    knees = {}
    for side in sides:
        costs = CostModel(model, 2, side // family.vae_scale_factor, dtype, Costs.COUNTED, cache_dir)
        rate = {}  # rows → predicted rows/s
        for rows in (2**k for k in range(max_rows.bit_length())):
            rate[rows] = rows / sum(costs.costs(device, threads, rows=rows).values())
        knee = 1
        while knee * 2 in rate and rate[knee * 2] >= KNEE_GAIN * rate[knee]:
            knee *= 2
        knees[side] = knee
    store(path, key, knees)
    return knees


def compare_costs(
    family: Family, device: str, dtype: torch.dtype, threads: int, cache_dir: Path | None
) -> dict[str, dict[str, float]]:
    """Per block, counted and measured seconds for one worker (`plan --costs measured` prints
    them side by side): at 2 rows of the native latent size, as plans are costed."""
    model = meta_denoiser(family)
    latent = family.native_size // family.vae_scale_factor
    counted = CostModel(model, 2, latent, dtype, Costs.COUNTED, cache_dir).costs(device, threads)
    measured = CostModel(model, 2, latent, dtype, Costs.MEASURED, cache_dir).costs(device, threads)
    return {block: {"counted_s": counted[block], "measured_s": measured[block]} for block in counted}


def fits_by_mode(
    family: Family,
    devices: str | Sequence[str],
    *,
    dtype: torch.dtype,
    batch: int,
    side: int,
    max_memory: Mapping[str, int] | str | None = None,
    folder: Path | None = None,
) -> dict[str, dict[str, object]]:
    """For each `--quantize` mode given alone: the denoiser's and the other parts' bytes, and
    whether a memory-balanced split over `devices` holds them (its stages' devices) or what it
    lacks (the planner's message), before anything loads."""
    model = meta_denoiser(family)
    layout = layout_of(model)
    out: dict[str, dict[str, object]] = {}
    for mode in QuantMode:
        setting = parse_quantize(mode)
        sizes, quantizations = resident_bytes(family, folder, dtype, setting)
        resident = sum(sizes.values())
        block_bytes = count_block_bytes(model, layout, dtype, quantizations.get(family.denoiser))
        experts = len(family.experts)
        denoisers = sum(block_bytes.values()) * experts
        summary: dict[str, object] = {"denoiser_bytes": denoisers, "other_bytes": resident}
        cpus = [d for d in resolve_devices(devices) if not d.startswith("cuda")]  # GPUs may be absent
        if problem := next((p for d in cpus if (p := refusal(mode, d))), None):
            out[str(mode)] = summary | {"fits": False, "why": problem}
            continue
        try:
            plan = plan_shards(
                model,
                devices,
                "memory",
                max_memory=max_memory,
                dtype=dtype,
                latent_size=side // family.vae_scale_factor,
                batch=batch,
                resident=resident,
                block_bytes=block_bytes,
                experts=experts,
            )
            summary |= {"fits": True, "stages": [s.device for s in plan.stages]}
        except PlanError as err:
            summary |= {"fits": False, "why": str(err)}
        out[str(mode)] = summary
    return out
