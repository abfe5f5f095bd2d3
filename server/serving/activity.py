"""Whether a step loop has work (`Activity`): what runs beside the loops (housekeeping, a
background compile) waits for every one of them to have none."""

from __future__ import annotations

import time
from collections.abc import Callable


class Activity:
    """One loop's: `idle_since`, the time.monotonic() it last ran out of work (None while it has
    work); `changed`, told whenever that flips (the service: `Service._activity`)."""

    def __init__(self) -> None:
        self.idle_since: float | None = time.monotonic()
        self.changed: Callable[[], None] | None = None

    def working(self, busy: bool) -> None:
        """The loop has work (True) or ran out of it (False); called under the loop's lock."""
        if busy == (self.idle_since is None):
            return
        self.idle_since = None if busy else time.monotonic()
        if self.changed is not None:
            self.changed()
