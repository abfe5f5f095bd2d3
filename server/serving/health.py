"""How the step loop is doing, as the probes need it: a heartbeat around every call into the
pipeline, consecutive failures, and errors that say the device itself is broken.

A call past its deadline (the step timeout, scaled by the call's work) is slow: `/readyz` fails
until it returns, so new requests go to other replicas. Far past it (STUCK_AFTER times) it is
stuck: `/livez` fails too (Kubernetes restarts the pod) and every waiting request is answered.
A call that returns clears both. `/readyz` also fails after too many failed steps in a row or
a sticky device error.
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
STUCK_AFTER = 4.0  # a call this many times past its deadline is stuck, not slow
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
    """Thread-safe: the loop writes, the watchdog, probes and metrics read. Each call into the
    pipeline has its own deadline, scaled by its work (see `StepLoop._call`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._call_started: float | None = None
        self._calls = 0  # calls begun: names the call in flight
        self.deadline_s = 0.0  # the call in flight's deadline
        self.last_beat: float | None = None  # time.time() when the last call ended (a gauge)
        self.failures_in_a_row = 0
        self.broken: str | None = None  # a sticky device error, once seen

    def begin(self, deadline_s: float) -> None:
        with self._lock:
            self._call_started, self.deadline_s = self._clock(), deadline_s
            self._calls += 1

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

    def overdue(self) -> tuple[int, float, float] | None:
        """(which call, seconds run, deadline) of a call in flight past its deadline, else None."""
        with self._lock:
            if self._call_started is None:
                return None
            running = self._clock() - self._call_started
            return (self._calls, running, self.deadline_s) if running > self.deadline_s else None


class Watchdog(threading.Thread):
    """Watches the call in flight: past its deadline it is slow (`on_slow`: readiness fails, new
    work goes elsewhere); past STUCK_AFTER times its deadline it is stuck (`on_stuck`: liveness
    fails, the pod is restarted). Each fires once per call, with (seconds run, deadline); a call
    that returns clears both (`calls.WatchedCalls`). Ends with `stop`."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        poll_s: float,
        on_slow: Callable[[float, float], None],
        on_stuck: Callable[[float, float], None],
        stop: threading.Event,
    ) -> None:
        super().__init__(name="diffshard-watchdog", daemon=True)
        self.heartbeat, self.poll_s, self.stop = heartbeat, poll_s, stop
        self.on_slow, self.on_stuck = on_slow, on_stuck

    def run(self) -> None:
        said: tuple[int, str] = (0, "")  # the call last reported, and as what
        while not self.stop.wait(self.poll_s):
            overdue = self.heartbeat.overdue()
            if overdue is None:
                continue
            call, running, deadline = overdue
            if running > STUCK_AFTER * deadline and said != (call, "stuck"):
                self.on_stuck(running, deadline)
                said = (call, "stuck")
            elif said[0] != call:
                self.on_slow(running, deadline)
                said = (call, "slow")
