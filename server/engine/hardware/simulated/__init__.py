"""Simulated GPUs with data: `cuda:0 … cuda:N-1` on a CPU-only host, backed by CPU memory.

Every multi-GPU mode must run whole requests (scheduler steps, decoding, numbers) before a
user's GPUs run it, and a lent machine has one GPU. `DIFFSHARD_SIMULATED_GPUS=2` (or `2x24GiB`)
makes `serve` and `plan` believe the host has two 24 GiB CUDA devices; tests enter `simulate()`.

How: a tensor on a simulated GPU is a `SimulatedTensor`, a wrapper whose `device` says `cuda:k`
and whose numbers are a CPU tensor. Its `__torch_function__` holds CUDA's rule that an op's
tensors share one device (0-dim CPU tensors pass as CUDA's scalars do; copies, `.to` and CPU
index tensors cross), raising CUDA's message, then runs the call on the CPU tensors and wraps
what it returns on the call's device. Calls that name a CUDA device without holding such a
tensor (`torch.zeros(..., device="cuda:1")`, a CPU tensor's `.to("cuda:0")`) go through a
`TorchFunctionMode` entered on every thread. The `torch.cuda` functions the code calls are
replaced while the simulation runs: each device has its own memory budget and allocation
counters (an allocation past the budget raises CUDA's out-of-memory error), each thread its own
current device, and the simulation counts device-wide synchronizations, host reads of device
values, copies from host memory that wait for the GPU (pageable memory, or not `non_blocking`),
the events the host waited for (where each was recorded), and calls a thread makes on a device
other than the one it set.

What it cannot show: speed (every op runs on the host's CPU, one after another: events time
wall clock), kernels' own numerics (CPU kernels, not cuBLAS or cuDNN), streams beyond the
default one, generators (a `cuda` generator draws from the CPU's algorithm), and torchao's
quantized weights (tensor subclasses of their own, which do not run inside this wrapper: float8
and int8 layouts are checked on a lent GPU).
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from server.engine.hardware.devices import parse_size
from server.engine.hardware.simulated.cuda import cuda_functions
from server.engine.hardware.simulated.gpus import SimulatedGpu, Simulation, active, set_active
from server.engine.hardware.simulated.tensors import NamesCuda, SimulatedTensor
from server.errors import DeviceError

__all__ = [
    "ENV",
    "SimulatedGpu",
    "SimulatedTensor",
    "Simulation",
    "active",
    "install",
    "simulate",
    "uninstall",
]

ENV = "DIFFSHARD_SIMULATED_GPUS"
DEFAULT_MEMORY = 24 * 2**30
_SPEC = re.compile(r"^\s*(\d+)\s*(?:[x×*]\s*([^,\s]+))?\s*(,\s*no-p2p)?\s*$")


def parse_spec(text: str) -> tuple[int, int, bool]:
    """`'2'` → (2, 24 GiB, peers); `'4x80GiB'` → (4, 80 GiB, peers); `'2x24GiB,no-p2p'`: GPUs
    that cannot reach each other's memory (GeForce cards, many VMs)."""
    match = _SPEC.match(text)
    if not match or int(match[1]) < 1:
        raise DeviceError(
            f"{ENV}={text!r}: write a count, optionally each device's memory and no-p2p: 2, 2x24GiB "
            "or 2x24GiB,no-p2p"
        )
    return int(match[1]), parse_size(match[2]) if match[2] else DEFAULT_MEMORY, not match[3]


_saved: dict[str, Any] = {}
_bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]
_entered = threading.local()


def _enter_mode() -> None:
    if not getattr(_entered, "mode", None):
        _entered.mode = NamesCuda()
        _entered.mode.__enter__()


def _bootstrap_with_mode(self: threading.Thread) -> None:
    _enter_mode()
    _bootstrap(self)


def install(count: int, memory: int = DEFAULT_MEMORY, *, peer_access: bool = True) -> Simulation:
    """Simulate `count` GPUs of `memory` bytes each in this process, until `uninstall()`."""
    if active() is not None:
        raise RuntimeError("GPUs are already simulated in this process")
    if torch.cuda.is_available():
        raise DeviceError(
            f"{ENV} is for hosts without CUDA: this host has {torch.cuda.device_count()} GPU(s)"
        )
    sim = Simulation([SimulatedGpu(i, memory) for i in range(count)], peer_access=peer_access)
    for name, replacement in cuda_functions(sim).items():
        _saved[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, replacement)
    threading.Thread._bootstrap_inner = _bootstrap_with_mode  # type: ignore[attr-defined]
    _enter_mode()
    set_active(sim)
    return sim


def uninstall() -> None:
    """Back to this host's own devices; tensors left on the simulated ones may no longer be used."""
    set_active(None)
    threading.Thread._bootstrap_inner = _bootstrap  # type: ignore[attr-defined]
    for name, original in _saved.items():
        if original is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)
    _saved.clear()
    mode = getattr(_entered, "mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)
        _entered.mode = None


@contextmanager
def simulate(count: int, memory: int = DEFAULT_MEMORY, *, peer_access: bool = True) -> Iterator[Simulation]:
    sim = install(count, memory, peer_access=peer_access)
    try:
        yield sim
    finally:
        uninstall()


def install_from_environment(environ: dict[str, str]) -> Simulation | None:
    """`DIFFSHARD_SIMULATED_GPUS=N`, `NxSIZE` or `NxSIZE,no-p2p`: simulate, saying so loudly."""
    text = environ.get(ENV, "").strip()
    if not text:
        return None
    count, memory, peers = parse_spec(text)
    sim = install(count, memory, peer_access=peers)
    print(
        f"diffshard: {ENV}={text}: simulating {count} CUDA device(s) of {memory / 2**30:g} GiB in CPU memory"
        f"{'' if peers else ' without peer access'} (for trying multi-GPU plans; nothing runs on a GPU)",
        file=sys.stderr,
    )
    return sim
