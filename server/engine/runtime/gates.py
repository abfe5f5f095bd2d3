"""Stage gates: several forwards in one ModelShard at once, each stage running one at a time.

Split by layers, a model runs one device at a time: while stage 1 computes, stage 0 waits.
With gates, every thread that calls the shard (a lane of the step loop, a micro-batch) holds
the lock of the stage it is in, taken when its forward reaches that stage's first block and
released when it moves on: while one micro-batch runs stage 1, the next runs stage 0, and a
micro-batch's next step enters stage 0 as soon as its scheduler step is done. A call holds
one lock at a time (the walker leaves a stage before it enters the next), so gates cannot
deadlock.

The gates also keep the books the metrics read: per stage, the seconds it was held (busy);
the seconds any forward was in flight (active); the forwards in flight now. A stage's busy
share of the active time is its utilisation; the rest is the pipeline's bubble. The times are
host times: on CUDA, where kernels run asynchronously, they are the time a stage held its
device's queue, not device time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from server.engine.runtime.tracing import hold_shared, release_shared


@dataclass(frozen=True)
class GateStats:
    busy_s: dict[str, float]  # per worker: seconds its stage was held
    active_s: float  # seconds with at least one forward in flight
    in_flight: int  # forwards (micro-batches) in the shard now


class StageGates:
    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._locks = [threading.Lock() for _ in self.names]
        self._books = threading.Lock()
        self._busy = [0.0] * len(self.names)
        self._held_since: list[float | None] = [None] * len(self.names)
        self._active_s = 0.0
        self._active_since = 0.0
        self._in_flight = 0

    def begin(self) -> None:
        """A call starts."""
        with self._books:
            if self._in_flight == 0:
                self._active_since = time.perf_counter()
            self._in_flight += 1

    def enter(self, stage: int) -> None:
        """A call reaches `stage`: wait for the call holding it to leave. Held, the gate is a lock
        the step loops take: a background compile's call (a warm-up's) never pauses inside."""
        self._locks[stage].acquire()
        hold_shared()
        with self._books:
            self._held_since[stage] = time.perf_counter()

    def leave(self, stage: int) -> None:
        """The call holding `stage` moves on (or ends, or failed)."""
        with self._books:
            since, self._held_since[stage] = self._held_since[stage], None
            self._busy[stage] += time.perf_counter() - since
        release_shared()
        self._locks[stage].release()

    def end(self) -> None:
        """A call is over (it left its stage first)."""
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
