"""Calls into the pipeline, watched: each under a deadline scaled by its work, faults injected
where tests ask for them, and slow or stuck said as such (`health.py` explains the two)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from server.engine.runtime.tracing import trace_gate
from server.pipeline import Pipeline
from server.pipeline.steps.state import RequestState
from server.serving.faults import inject_fault
from server.serving.health import Heartbeat, Watchdog
from server.serving.stats import CALLS, LoopStats

log = logging.getLogger("diffshard")


class WatchedCalls:
    """`calls(method, items)` runs `method(items)` on the step loop's thread; the watchdog thread
    sets `slow` and `stuck` (and calls `on_stuck` with why) while it runs past its deadline."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        step_timeout_s: float,
        max_batch: int,
        native_pixels: int,
        inject_faults: bool,
        closed: threading.Event,
        on_stuck: Callable[[str], None],
    ) -> None:
        self.pipeline = pipeline
        self.step_timeout_s = step_timeout_s  # a call of max_batch native-size rows; more work, more time
        self.max_batch, self.native_pixels = max_batch, native_pixels
        self.inject_faults, self._closed, self._on_stuck_then = inject_faults, closed, on_stuck
        self.heartbeat = Heartbeat()
        self.slow: str | None = None  # a call is past its deadline: not ready for more work
        self.stuck: str | None = None  # a call is far past it (wedged): not live
        self.slow_calls = self.stuck_calls = 0
        # seconds per method: every key there from the start, so a reader's copy never sees one added
        self.seconds: Counter = Counter(dict.fromkeys(CALLS, 0.0))
        poll_s = min(1.0, step_timeout_s / 4)
        Watchdog(self.heartbeat, poll_s, self._on_slow, self._on_stuck, closed).start()

    def __call__(self, method: Callable[[list], Any], items: list) -> Any:
        deadline_s = self.deadline_s(items)
        self.heartbeat.begin(deadline_s)
        try:
            if self.inject_faults:
                workers = getattr(getattr(self.pipeline, "lane", None), "workers", None)
                inject_fault(method.__name__, items, self._closed, deadline_s, workers)
            with trace_gate().call():  # never beside a background compile's trace
                started = time.perf_counter()
                result = method(items)
            try:
                self.pipeline.synchronize()  # so step times are device times, not enqueue times
            except BaseException:
                _close_opened(result, items)  # a CUDA error surfaces here: no one else holds them
                raise
            if method.__name__ in self.seconds:
                self.seconds[method.__name__] += time.perf_counter() - started
        finally:
            running_s = self.heartbeat.running_for()
            self.heartbeat.end()
            if self.slow or self.stuck:  # it returned after all: serve again
                log.warning("the step loop goes on: a call returned after %.1f s", running_s)
                self.slow = self.stuck = None
        self.heartbeat.succeeded()
        return result

    def count_into(self, stats: LoopStats) -> None:
        """The calls' counters into the loop's `stats` (read under the loop's lock)."""
        stats.slow_calls, stats.stuck_calls = self.slow_calls, self.stuck_calls
        stats.call_seconds = self.seconds.copy()

    def deadline_s(self, items: list) -> float:
        """The step timeout, scaled by the call's work where it exceeds `max_batch` native-size
        rows (rows × pixels: a legal request of 16 rows at 4× the native area gets 4× the time)."""
        work = 0.0
        for item in items:  # requests to start (2 rows each, at most), or states to step or decode
            request = getattr(item, "request", item)
            rows = getattr(item, "rows", 2)
            frames = getattr(request, "latent_frames", 1)  # a video weighs its latent frames
            work += rows * (request.width or 1) * (request.height or 1) * frames / self.native_pixels
        return self.step_timeout_s * max(1.0, work / self.max_batch)

    def _on_slow(self, running_s: float, deadline_s: float) -> None:
        self.slow = f"a step has run {running_s:.0f} s, past its deadline of {deadline_s:.0f} s"
        self.slow_calls += 1
        log.warning("%s (DIFFSHARD_STEP_TIMEOUT_S, scaled by its work): not ready meanwhile", self.slow)

    def _on_stuck(self, running_s: float, deadline_s: float) -> None:
        self.stuck = (
            f"the step loop is stuck: a call has run {running_s:.0f} s (its deadline: {deadline_s:.0f} s)"
        )
        self.stuck_calls += 1
        log.critical("%s; answering every waiting request 503", self.stuck)
        self._on_stuck_then(self.stuck)


def _close_opened(result: Any, items: list) -> None:
    """Close the states in `result` that the call opened (a `start`'s): the caller never sees them,
    so their pool scopes would stay open forever."""
    if not isinstance(result, list):
        return
    for state in result:
        if isinstance(state, RequestState) and not any(state is item for item in items):
            state.close()
