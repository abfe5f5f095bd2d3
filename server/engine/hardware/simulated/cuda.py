"""`torch.cuda` while GPUs are simulated: the functions and classes the code calls, answering
for the simulated devices (`simulated/__init__.py`)."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from server.engine.hardware.simulated.gpus import (
    Simulation,
    active,
    current_device,
    current_streams,
    device_index,
    set_current_device,
)


class _Device:
    """`torch.cuda.device(d)`: this thread's current device while inside."""

    def __init__(self, device: Any) -> None:
        self.index = device_index(device) if device is not None and device != -1 else None

    def __enter__(self) -> None:
        self.before = current_device()
        if self.index is not None:
            set_current_device(self.index)

    def __exit__(self, *exc: object) -> None:
        set_current_device(self.before)


class _Event:
    """A CUDA event: on simulated GPUs every op has finished when it returns, so an event's
    time is the host's clock when it is recorded. Its device and where it was recorded are
    kept, and the simulation counts the host's waits for it (`Simulation.waited`)."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.time: float | None = None
        self.device, self.recorded_at = current_device(), ""

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()
        self.device = stream.device.index if stream is not None else current_device()
        caller = traceback.extract_stack(limit=2)[0]
        self.recorded_at = f"{Path(caller.filename).name}:{caller.lineno}"

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if (sim := active()) is not None:
            sim.waited.append((self.device, self.recorded_at, threading.current_thread().name))

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("CUDA error: device not ready (an event not recorded)")
        return (end.time - self.time) * 1000.0


@dataclass(frozen=True, eq=False)
class _Stream:
    """A stream: its work runs in order, as everything does here; only which one is current
    (each thread's, a device) is kept, for the code that asserts it."""

    device: torch.device
    default: bool = False

    def __eq__(self, other: object) -> bool:  # every device's default stream is one stream
        if self.default and isinstance(other, _Stream) and other.default:
            return self.device == other.device
        return self is other

    def __hash__(self) -> int:
        return hash(self.device)

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: _Stream) -> None:
        pass

    def wait_event(self, event: _Event) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record()
        return event


def cuda_functions(sim: Simulation) -> dict[str, Any]:
    def properties(device: Any = None) -> SimpleNamespace:
        gpu = sim.gpu(device)
        return SimpleNamespace(
            name=gpu.name,
            total_memory=gpu.total,
            major=9,
            minor=0,
            multi_processor_count=132,
            uuid=f"simulated-{gpu.index}",
            is_integrated=False,
        )

    def set_device(device: Any) -> None:
        set_current_device(device_index(device))

    def default_stream(device: Any = None) -> _Stream:
        return _Stream(torch.device("cuda", device_index(device)), default=True)

    def current_stream(device: Any = None) -> _Stream:
        return current_streams().get(device_index(device)) or default_stream(device)

    def new_stream(device: Any = None, priority: int = 0) -> _Stream:
        return _Stream(torch.device("cuda", device_index(device)))

    @contextmanager
    def stream(chosen: _Stream | None) -> Iterator[None]:
        if chosen is None:
            yield
            return
        streams = current_streams()
        index = chosen.device.index
        before = streams.get(index)
        streams[index] = chosen
        try:
            with _Device(chosen.device):
                yield
        finally:
            streams[index] = before

    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "device_count": lambda: len(sim.gpus),
        "current_device": current_device,
        "set_device": set_device,
        "device": _Device,
        "synchronize": sim.synchronized,
        "mem_get_info": lambda device=None: (
            sim.gpu(device).total - sim.gpu(device).allocated,
            sim.gpu(device).total,
        ),
        "memory_allocated": lambda device=None: sim.gpu(device).allocated,
        "memory_reserved": lambda device=None: sim.gpu(device).allocated,
        "max_memory_allocated": lambda device=None: sim.gpu(device).peak,
        "reset_peak_memory_stats": lambda device=None: setattr(
            sim.gpu(device), "peak", sim.gpu(device).allocated
        ),
        "empty_cache": lambda: None,
        "get_device_name": lambda device=None: sim.gpu(device).name,
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_properties": properties,
        "is_bf16_supported": lambda including_emulation=True: True,
        "can_device_access_peer": lambda device, peer: sim.peer_access,
        "Event": _Event,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "Stream": new_stream,
        "stream": stream,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
    }
