"""Stage gates: several forwards in one ModelShard at once, each stage running one at a time.

Split by layers, a model runs one device at a time: while stage 1 computes, stage 0 waits.
With gates, every thread that calls the shard (a lane of the step loop, a micro-batch) holds
the lock of the stage it is in, taken when its forward reaches that stage's first block and
released when it moves on: while one micro-batch runs stage 1, the next runs stage 0, and a
micro-batch's next step enters stage 0 as soon as its scheduler step is done. A thread holds
one lock at a time (it releases before it waits), so gates cannot deadlock.

The gates also keep the books the metrics read: per stage, the seconds it was held (busy);
the seconds any forward was in flight (active); the forwards in flight now. A stage's busy
share of the active time is its utilisation; the rest is the pipeline's bubble. The times are
host times: on CUDA, where kernels run asynchronously, they are the time a stage held its
device's queue, not device time.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def worker_names(devices: Sequence[str]) -> list[str]:
    """A name per stage or replica: its device, indexed where a device is listed more than once
    (`cpu,cpu`: two CPU workers sharing the host's cores are `cpu:0` and `cpu:1`)."""
    counts = Counter(devices)
    seen: Counter[str] = Counter()
    names = []
    for device in devices:
        names.append(f"{device}:{seen[device]}" if counts[device] > 1 and ":" not in device else device)
        seen[device] += 1
    if len(set(names)) != len(names):
        raise ValueError(f"a device is listed twice: {list(devices)}")
    return names


@dataclass(frozen=True)
class GateStats:
    busy_s: dict[str, float]  # per worker: seconds its stage was held
    active_s: float  # seconds with at least one forward in flight
    in_flight: int  # forwards (micro-batches) in the shard now


class StageGates:
    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._locks = [threading.Lock() for _ in self.names]
        self._local = threading.local()  # the calling thread's stage
        self._books = threading.Lock()
        self._busy = [0.0] * len(self.names)
        self._held_since: list[float | None] = [None] * len(self.names)
        self._active_s = 0.0
        self._active_since = 0.0
        self._in_flight = 0

    def begin(self) -> None:
        """A forward starts on this thread."""
        self._local.stage = None
        with self._books:
            if self._in_flight == 0:
                self._active_since = time.perf_counter()
            self._in_flight += 1

    def enter(self, stage: int) -> None:
        """The forward reaches `stage` (a no-op if it is there already)."""
        current = self._local.stage
        if current == stage:
            return
        if current is not None:
            self._release(current)
        self._locks[stage].acquire()
        self._local.stage = stage
        with self._books:
            self._held_since[stage] = time.perf_counter()

    def end(self) -> None:
        """The forward on this thread is over (or failed): let go of its stage."""
        current = getattr(self._local, "stage", None)
        if current is not None:
            self._release(current)
            self._local.stage = None
        with self._books:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._active_s += time.perf_counter() - self._active_since

    def stats(self) -> GateStats:
        """The books now, the stages held at this moment counted up to it."""
        with self._books:
            now = time.perf_counter()
            active = self._active_s + (now - self._active_since if self._in_flight else 0.0)
            busy = [
                seconds + (now - since if since is not None else 0.0)
                for seconds, since in zip(self._busy, self._held_since, strict=True)
            ]
            return GateStats(dict(zip(self.names, busy, strict=True)), active, self._in_flight)

    def _release(self, stage: int) -> None:
        with self._books:
            since, self._held_since[stage] = self._held_since[stage], None
            self._busy[stage] += time.perf_counter() - since
        self._locks[stage].release()
