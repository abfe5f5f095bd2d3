"""Seconds per block, the numbers a plan is balanced and ranked by: counted (the default) or measured.

**Counted** (`--costs counted`): each block's ops, counted on the meta device (`work.py`), run
through a roofline with per-op overhead, with the speeds of the worker's device, dtype and
thread count (`calibrate.py`, timed once per host and cached):

    seconds(op) = max(FLOPs / FLOP/s of its kind at its GEMM's size, bytes / bandwidth) + overhead

A roofline because a block's convolutions and projections are compute-bound while its norms
and activations are memory-bound; the FLOP/s depend on the GEMM's rows because the deep,
small-latent levels of a UNet run several times below the wide levels' rate; the overhead
because a small model is bound by dispatch, which FLOPs do not show. It takes about a second
for an SD-sized model at any latent size, with no weights.

**Measured** (`--costs measured`): every block timed on a random-weight twin (`profile.py`):
the truth for this host, at the price of building and running the model (minutes for an
SD-sized one on a CPU). The results are cached on disk, keyed by the model's config, dtype, rows,
latent size, device and threads, so a second `plan` or `serve` reuses them.

Workers that share a CPU share its cores and its memory bandwidth: `CpuShare` slows each of
`workers` busy workers of `threads` threads when together they ask more than `cores`.

A GPU this host lacks (named for a plan) cannot be calibrated or timed: its counted work runs
through the same roofline with a device profile's published figures (`gpus.py`) instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
from torch import nn

from server.engine.hardware import simulated
from server.engine.hardware.devices import absent, device_kind
from server.engine.hardware.gpus import (
    ATTENTION_SHARE,
    BANDWIDTH_SHARE,
    CONV_SHARE,
    DEFAULT_PROFILE,
    MATMUL_SHARE,
    OP_OVERHEAD_S,
    GpuProfile,
    gpu_profile,
)
from server.engine.planning.cache import lookup, store
from server.engine.planning.calibrate import DeviceSpeed, cached_calibration, cached_shared_overhead
from server.engine.planning.profile import profile_block_costs
from server.engine.planning.sequence import Link, cpu_link, gpu_link
from server.engine.planning.work import BlockWork, ModelWork, count_work
from server.errors import PlanError


class Costs(StrEnum):
    COUNTED = "counted"  # FLOPs, bytes and ops on the meta device, with a cached calibration
    MEASURED = "measured"  # every block timed on a random-weight twin, cached


def block_seconds(work: BlockWork, speed: DeviceSpeed, overhead_s: float | None = None) -> float:
    """The roofline with overhead (see the module's docstring) for one block."""
    overhead_s = speed.op_overhead_s if overhead_s is None else overhead_s
    seconds = 0.0
    for op in work.ops:
        memory = op.bytes / speed.bytes_per_s
        compute = op.flops / speed.rate(op.kind, op.rows) if op.kind != "memory" else 0.0
        seconds += max(compute, memory) + overhead_s
    return seconds


def profile_speed(profile: GpuProfile, dtype: torch.dtype) -> DeviceSpeed:
    """What a calibration would say of `profile`'s GPU: its published peaks, scaled by the shares
    real kernels reach (`gpus.py`), at every GEMM size (small ones are bound by the weights'
    bytes, which the roofline sees)."""
    flops = profile.tflops(dtype) * 1e12
    return DeviceSpeed(
        device=f"{profile.name} profile",
        dtype=str(dtype).removeprefix("torch."),
        threads=1,
        matmul=((32, flops * MATMUL_SHARE), (2048, flops * MATMUL_SHARE)),
        conv=((32, flops * CONV_SHARE), (2048, flops * CONV_SHARE)),
        attention_flops_per_s=flops * ATTENTION_SHARE,
        bytes_per_s=profile.bandwidth_gb_s * 1e9 * BANDWIDTH_SHARE,
        op_overhead_s=OP_OVERHEAD_S,
    )


def predicted(device: str) -> bool:
    """A CUDA device whose speed a device profile predicts: absent from this host, or simulated in
    CPU memory (`simulated.py`: its blocks would time the CPU, not a GPU)."""
    return absent(device) or (simulated.active() is not None and torch.device(device).type == "cuda")


def peer_access(devices: Sequence[str]) -> list[tuple[str, str]]:
    """The pairs of this host's GPUs among `devices` that cannot reach each other's memory."""
    gpus = sorted({d for d in devices if d.startswith("cuda") and not absent(d)})
    return [
        (a, b)
        for i, a in enumerate(gpus)
        for b in gpus[i + 1 :]
        if not torch.cuda.can_device_access_peer(torch.device(a), torch.device(b))
    ]


def profile_note(devices: Sequence[str], profile: str | None, dtype: torch.dtype) -> str:
    """What the plan's output says of the devices predicted from a profile ("" when none is)."""
    missing = list(dict.fromkeys(d for d in devices if predicted(d)))
    if not missing:
        return ""
    where = "not on this host" if absent(missing[0]) else "simulated in CPU memory"
    chosen = gpu_profile(profile)
    how = " (the default; --device-profile chooses another)" if chosen.name == DEFAULT_PROFILE else ""
    return (
        f"{', '.join(missing)} {where}: predicted from the {chosen.name} profile{how}, "
        f"{chosen.describe(dtype)}, at {MATMUL_SHARE:.0%} and {BANDWIDTH_SHARE:.0%} of them"
    )


@dataclass
class CostModel:
    """Seconds per block of `model` for `rows` rows of `latent_size`² latents in `dtype`, on a
    worker of a given device and thread count: `costs(device, threads)`; `costs(..., rows=1)`
    for another row count (counted work is scaled, not counted again)."""

    model: nn.Module
    rows: int
    latent_size: int
    dtype: torch.dtype
    mode: Costs = Costs.COUNTED
    cache_dir: Path | None = None
    profile: str | None = None  # the GPU profile CUDA devices this host lacks are predicted from
    peers: bool = True  # the GPUs reach each other's memory (P2P); else copies go through the host

    def __post_init__(self) -> None:
        self._work: ModelWork | None = None
        self._costs: dict[tuple[str, int, int], dict[str, float]] = {}

    @property
    def work(self) -> ModelWork:
        if self._work is None:
            self._work = count_work(self.model, self.rows, self.latent_size, self.dtype)
        return self._work

    def costs(
        self,
        device: str,
        threads: int = 1,
        rows: int | None = None,
        *,
        workers: int = 1,
        beside_server: bool = False,
    ) -> dict[str, float]:
        """Seconds per block on one of `workers` workers of `device`'s kind running at once (CPU
        workers share the interpreter and the cores; `beside_server`: the server's own threads
        too, as when the workers fill the CPU quota)."""
        cpu = torch.device(device).type == "cpu"
        threads, workers, beside_server = (threads, workers, beside_server) if cpu else (1, 1, False)
        rows = rows or self.rows
        key = (self._kind(device), threads, rows, workers, beside_server)
        if key not in self._costs:
            if self.mode == Costs.COUNTED:
                self._costs[key] = self.predicted(device, threads, rows, workers, beside_server)
            else:  # timed alone at `self.rows` and scaled: sharing and other row counts are not timed
                measured = self.measured(device, threads, self.rows)
                self._costs[key] = {block: s * rows / self.rows for block, s in measured.items()}
        return self._costs[key]

    def predicted(
        self,
        device: str,
        threads: int = 1,
        rows: int | None = None,
        workers: int = 1,
        beside_server: bool = False,
    ) -> dict[str, float]:
        if predicted(device):
            speed = profile_speed(gpu_profile(self.profile), self.dtype)
        else:
            speed = cached_calibration(device, self.dtype, threads, self.cache_dir)
        overhead = None
        if torch.device(device).type == "cpu":
            overhead = cached_shared_overhead(speed, workers, threads, beside_server, self.cache_dir)
        work = self.work if rows in (None, self.rows) else self.work.at_rows(rows)
        return {name: block_seconds(block, speed, overhead) for name, block in work.blocks.items()}

    def link(self, device: str, threads: int = 1) -> Link:
        """How a sequence group's rank on `device` gets its peers' tensors (`sequence.py`)."""
        if torch.device(device).type == "cpu":
            return cpu_link(cached_calibration(device, self.dtype, threads, self.cache_dir).bytes_per_s)
        return gpu_link(self.profile, self.peers)

    def measured(self, device: str, threads: int = 1, rows: int | None = None) -> dict[str, float]:
        """Timed blocks (five runs after a warm-up), from the cache when this exact case ran before."""
        rows = rows or self.rows
        if predicted(device):
            raise PlanError(
                f"{device} is not on this host (or simulated): its blocks cannot be timed; --costs counted "
                "predicts them from a device profile"
            )
        threads = threads if torch.device(device).type == "cpu" else 1
        key = self._measured_key(device, threads, rows)
        path = self.cache_dir / "measured.json" if self.cache_dir is not None else None
        if (stored := lookup(path, key)) is not None:
            return dict(stored)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            seconds = profile_block_costs(self.model, rows, self.latent_size, self.dtype, device, repeats=5)
        finally:
            torch.set_num_threads(before)
            if torch.device(device).type == "cuda":  # the twin is gone: later budgets must not see it
                torch.cuda.empty_cache()
        store(path, key, seconds)
        return seconds

    def _kind(self, device: str) -> str:
        return f"{gpu_profile(self.profile).name} profile" if predicted(device) else device_kind(device)

    def _measured_key(self, device: str, threads: int, rows: int) -> dict[str, object]:
        config = json.dumps(dict(self.model.config), sort_keys=True, default=str)
        return {
            "model": f"{type(self.model).__name__}:{hashlib.sha256(config.encode()).hexdigest()[:16]}",
            "dtype": str(self.dtype),
            "rows": rows,
            "latent_size": self.latent_size,
            "device": device_kind(device),
            "threads": threads,
            "torch": torch.__version__,
        }
