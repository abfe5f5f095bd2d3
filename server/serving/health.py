"""How the step loop is doing, as the probes need it: a heartbeat around every call into the
pipeline, consecutive failures, and errors that say the device itself is broken.

`/livez` fails when a call has run longer than the step timeout (Kubernetes restarts the pod);
`/readyz` also fails after too many failed steps in a row or a sticky device error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

# Allocation failures that are not torch.OutOfMemoryError: cuBLAS/cuDNN workspaces, raw CUDA.
_OOM_TEXT = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
)
# CUDA errors after which the context is unusable: every later call fails the same way.
_STICKY_TEXT = ("illegal memory access", "device-side assert", "unspecified launch failure", "ECC error")


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or any(text in str(err) for text in _OOM_TEXT)


def is_sticky(err: BaseException) -> bool:
    """A device error that leaves the CUDA context broken (the process must restart)."""
    accelerator = getattr(torch, "AcceleratorError", None)  # torch ≥ 2.8
    if accelerator is not None and isinstance(err, accelerator):
        return True
    return any(text in str(err) for text in _STICKY_TEXT)


class Heartbeat:
    """Thread-safe: the loop writes, probes and metrics read."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._call_started: float | None = None
        self.last_beat: float | None = None  # time.time() when the last call ended (a gauge)
        self.failures_in_a_row = 0
        self.broken: str | None = None  # a sticky device error, once seen

    def begin(self) -> None:
        with self._lock:
            self._call_started = self._clock()

    def end(self) -> None:
        with self._lock:
            self._call_started = None
            self.last_beat = time.time()

    def succeeded(self) -> None:
        with self._lock:
            self.failures_in_a_row = 0

    def failed(self, err: BaseException) -> None:
        with self._lock:
            if not is_out_of_memory(err):  # too big a batch is not a sick device
                self.failures_in_a_row += 1
            if is_sticky(err):
                self.broken = f"{type(err).__name__} (a device error that does not clear)"

    def running_for(self) -> float:
        """Seconds the call in flight has run; 0 between calls."""
        with self._lock:
            return 0.0 if self._call_started is None else self._clock() - self._call_started


class Watchdog(threading.Thread):
    """Calls `on_stuck(seconds)` once when a call has run longer than `timeout_s`; ends with `stop`."""

    def __init__(
        self, heartbeat: Heartbeat, timeout_s: float, on_stuck: Callable[[float], None], stop: threading.Event
    ) -> None:
        super().__init__(name="diffshard-watchdog", daemon=True)
        self.heartbeat, self.timeout_s, self.on_stuck, self.stop = heartbeat, timeout_s, on_stuck, stop

    def run(self) -> None:
        while not self.stop.wait(min(1.0, self.timeout_s / 4)):
            running = self.heartbeat.running_for()
            if running > self.timeout_s:
                self.on_stuck(running)
                return
