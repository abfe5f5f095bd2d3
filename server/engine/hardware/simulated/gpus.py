"""The simulated GPUs (`simulated/__init__.py`): each one's memory and counters, each thread's
current device (CUDA keeps one a thread), and what the code did with them."""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

_active: Simulation | None = None


def active() -> Simulation | None:
    """The simulation running in this process, if any."""
    return _active


def set_active(sim: Simulation | None) -> None:
    global _active
    _active = sim


@dataclass
class SimulatedGpu:
    index: int
    total: int
    allocated: int = 0
    peak: int = 0

    @property
    def name(self) -> str:
        return f"Simulated GPU {self.index} (CPU memory)"


@dataclass
class Simulation:
    """The simulated devices and what the code did with them."""

    gpus: list[SimulatedGpu]
    peer_access: bool = True  # what `torch.cuda.can_device_access_peer` answers
    syncs: list[tuple[int, str, str]] = field(default_factory=list)  # device, thread, caller
    reads: Counter[str] = field(default_factory=Counter)  # device values read on the host, by thread
    # copies from the host the host waited on (pageable memory, or not non_blocking), by thread:
    # CUDA makes such a copy wait for everything queued on the stream first
    uploads: Counter[str] = field(default_factory=Counter)
    waited: list[tuple[int, str, str]] = field(default_factory=list)  # events: device, recorded at, thread
    # calls on a device other than the thread's own: (thread, the call's device, the thread's)
    foreign: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    _storages: dict[int, list[int]] = field(default_factory=dict)  # storage → [gpu, bytes, wrappers]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gpu(self, device: torch.device | str | int | None) -> SimulatedGpu:
        index = device_index(device)
        if not 0 <= index < len(self.gpus):
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (cuda:{index} of {len(self.gpus)} simulated)"
            )
        return self.gpus[index]

    def reset_counts(self) -> None:
        self.syncs.clear()
        self.reads.clear()
        self.uploads.clear()
        self.waited.clear()
        self.foreign.clear()
        for gpu in self.gpus:
            gpu.peak = gpu.allocated

    # -- memory: a storage is counted once, however many wrappers view it ----------------------

    def allocate(self, data: torch.Tensor, device: torch.device) -> int:
        """Count `data`'s storage on `device` (once, however many tensors view it); its key for
        `release`. CUDA's out-of-memory error past the device's budget."""
        gpu = self.gpu(device)
        key = data.untyped_storage()._cdata
        nbytes = data.untyped_storage().nbytes()
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                if gpu.allocated + nbytes > gpu.total:
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate {nbytes / 2**20:.2f} MiB. "
                        f"GPU {gpu.index} has a total capacity of {gpu.total / 2**30:.2f} GiB of which "
                        f"{(gpu.total - gpu.allocated) / 2**30:.2f} GiB is free (simulated)."
                    )
                entry = self._storages[key] = [gpu.index, nbytes, 0]
                gpu.allocated += nbytes
                gpu.peak = max(gpu.peak, gpu.allocated)
            entry[2] += 1
        return key

    def holds(self, data: torch.Tensor) -> bool:
        """Whether `data`'s storage is a simulated GPU's (the CPU memory behind its tensors)."""
        return data.layout == torch.strided and data.untyped_storage()._cdata in self._storages

    def release(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[2] -= 1
            if entry[2] == 0:
                del self._storages[key]
                self.gpus[entry[0]].allocated -= entry[1]

    # -- what threads do ------------------------------------------------------------------------

    def touched(self, device: torch.device) -> None:
        current = current_device()
        if device.index != current:
            self.foreign[(threading.current_thread().name, str(device), f"cuda:{current}")] += 1

    def synchronized(self, device: Any = None) -> None:
        index = device_index(device)
        caller = traceback.extract_stack(limit=3)[0]
        self.syncs.append((index, threading.current_thread().name, f"{caller.filename}:{caller.lineno}"))


_thread = threading.local()  # `.device`: this thread's current CUDA device; `.streams`: its streams


def current_device() -> int:
    """This thread's current device: 0 until it sets one, as on CUDA."""
    return getattr(_thread, "device", 0)


def set_current_device(index: int) -> None:
    _thread.device = index


def current_streams() -> dict[int, Any]:
    """This thread's current stream of each device, where it chose one (else the default)."""
    if not hasattr(_thread, "streams"):
        _thread.streams = {}
    return _thread.streams


def device_index(device: torch.device | str | int | None) -> int:
    """The index of CUDA device `device` (a bare `cuda` or None: this thread's current one)."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return device.index if device.index is not None else current_device()
