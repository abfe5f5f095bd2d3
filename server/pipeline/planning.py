"""Plan a model's split before loading it: `serve` and `plan` both call `plan_model`, so the plan
a user prints is the plan the server runs.

The activation reserve is sized for the largest work the service admits (`batch` rows at the
largest allowed image side), and the text encoders' and VAE's bytes count against the budget
of the device they will sit on (the first stage's).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from server.engine import CostModel, Costs, ParallelPlan, plan_parallel
from server.engine.hardware.devices import device_kind, resolve_devices
from server.engine.planning.cache import lookup, store
from server.engine.planning.costs import profile_note
from server.pipeline.families import Family, meta_denoiser, reference_bytes
from server.pipeline.loader import part_bytes


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
) -> ParallelPlan:
    """The plan for `family`'s denoiser (built on the meta device) over `devices`, reserving
    activations for `batch` rows of `side`² images; its encoders and VAE (the folder's, or a
    reference architecture's published ones) count on the first stage's device. `parallel`
    chooses replicas, pipelined stages or both (`server.engine.plan_parallel`) from block costs
    `costs` (counted or measured, at 2 rows of the native size: the typical request; measured
    ones and calibrations kept in `cache_dir`; GPUs this host lacks predicted from
    `device_profile`'s published peaks, said in the plan); `threads` is the CPU's intra-op
    threads in all (a lone CPU worker runs the count predicted fastest up to it, or all of them
    without `pick_threads`)."""
    if folder is not None:  # they sit with the first stage (see Pipeline)
        index = family.config.index
        parts = ("vae", *(n for n in family.text_encoders if index.get(n) and index[n][0] is not None))
        resident = part_bytes(folder, parts, dtype)
    else:  # a reference architecture's, built on the meta device (none for most)
        resident = reference_bytes(family, dtype)
    model = meta_denoiser(family)
    latent = family.native_size // family.vae_scale_factor  # the typical request

    model_costs = CostModel(model, 2, latent, dtype, Costs(costs), cache_dir, device_profile)
    where = f"{costs} at 2 rows of {latent}² latents"
    if note := profile_note(resolve_devices(devices), device_profile, dtype):
        where += f"; {note}"
    return plan_parallel(
        model,
        devices,
        "off" if device_map else parallel,  # an explicit block map is one split
        strategy,
        threads=threads,
        block_costs=model_costs.costs,
        costs_note=where,
        pick_threads=pick_threads,
        timed=costs == Costs.MEASURED,
        max_memory=max_memory,
        device_map=device_map,
        dtype=dtype,
        latent_size=side // family.vae_scale_factor,
        batch=batch,
        resident=resident,
    )


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
