"""Waiting in tests: poll a condition with a short exponential backoff until a deadline, never a
hot loop (which starves the 2-core host the code under test runs on) and never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

FIRST_PAUSE_S = 0.005
LONGEST_PAUSE_S = 0.2


def wait_until(condition: Callable[[], T], timeout_s: float, what: str) -> T:
    """Call `condition` until it returns a truthy value and return that value; pause 5 ms, then
    twice as long each time up to 200 ms, between tries. At the deadline, AssertionError naming
    `what` and the last value. `condition` is always tried once more after the last pause."""
    deadline = time.monotonic() + timeout_s
    pause = FIRST_PAUSE_S
    while True:
        value = condition()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what}: not reached within {timeout_s} s; last value: {value!r}")
        time.sleep(min(pause, left))
        pause = min(2 * pause, LONGEST_PAUSE_S)
