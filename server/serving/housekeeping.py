"""Giving back what a burst left behind, while the service is idle: on its own thread, so no
step loop's lock is held while the pool trims and the allocator returns memory to the OS."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("diffshard")

IDLE_S = 30.0  # housekeeping runs every this long while every lane has been idle this long


class Housekeeper(threading.Thread):
    """Calls `tidy()` every `every_s` while every lane has been idle at least that long, until it
    says the idle floor is reached (True: nothing left to give back); again after the next work.
    `idle_since()` gives each lane's time.monotonic() of going idle (None: it has work)."""

    def __init__(
        self,
        idle_since: Callable[[], Sequence[float | None]],
        tidy: Callable[[], bool],
        stop: threading.Event,
        every_s: float = IDLE_S,
    ) -> None:
        super().__init__(name="diffshard-housekeeping", daemon=True)
        self.idle_since, self.tidy, self.stop, self.every_s = idle_since, tidy, stop, every_s
        self.floor_after: float | None = None  # the lanes' last going idle when the floor was reached

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            since = self.idle_since()
            if any(s is None for s in since):
                continue  # busy
            # At the floor since the lanes last went idle: nothing to give back. Work that came and
            # went between two wake-ups moved their idle times, so a burst is never missed.
            latest = max(since)
            if latest == self.floor_after or time.monotonic() - latest < self.every_s:
                continue
            try:
                if self.tidy():
                    self.floor_after = latest
                empty_device_caches()
            except Exception:
                log.exception("idle housekeeping failed")


def empty_device_caches() -> None:
    """Give CUDA's cached blocks back to the driver: what the pool trimmed stays reserved by
    PyTorch's caching allocator (and out of other processes' reach) until emptied."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
