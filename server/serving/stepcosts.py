"""What a denoiser call costs on this step loop, as measured: seconds against the call's work
(pixel-rows: each row × its image's pixels × a video's latent frames), so that `Lineup.pick` can
tell whether background rows would slow an interactive step.

A call's time is no one line everywhere. On a CPU it grows about in proportion to its rows past a
couple; on a GPU it is nearly flat up to a knee (the rows the device runs side by side), then
grows; compiled buckets make some row counts cheaper than fewer rows run eagerly. So the
measurement is a curve, not a fitted line (one line through a GPU's flat part and its knee
would price rows under the knee as dear and rows past it as cheap): each work among the loop's
recent calls has the median of its seconds (one call slowed by the HTTP side's threads does not
move it), made non-decreasing by pooling neighbours that dip (isotonic regression, weighted by
calls: a few slow small calls must not raise every larger one), and a work between two measured
ones is read off the segment between them.

Only recent calls count (`WINDOW`), so that works timed while the host was busier or a compile
ran do not stand beside works timed since; and nothing is predicted (None) outside the works
measured: no background row joins a call larger than any recently timed. A work the loop no
longer calls leaves the window, and with it the prediction, until the loop calls it again: the
curve stays measured, never remembered. Background steps taken whole, while interactive work is
away, time the large calls, so a GPU learns its free rows from the batch itself.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable

from server.requests import GenerationRequest
from server.serving.jobs import Job

WINDOW = 96  # the latest calls, whatever their work, that the curve is read from
SAMPLES = 5  # calls of a work in the window before it counts


def work_of(request: GenerationRequest, rows: int) -> int:
    """The pixel-rows `rows` rows of `request` weigh in a call (as `Job.pixel_rows` counts them)."""
    return rows * request.width * request.height * request.latent_frames


class StepCosts:
    """One loop's measured calls: `observe` each denoiser call, `seconds` predicts one,
    `step_seconds` a step's calls."""

    def __init__(self) -> None:
        self._calls: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (work, seconds), oldest first
        self._measured: list[tuple[int, float]] | None = None  # read off the window once per change

    def observe(self, work: int, seconds: float) -> None:
        self._calls.append((work, seconds))
        self._measured = None

    def measured(self) -> list[tuple[int, float]]:
        """(work, seconds) of each work called SAMPLES times or more in the window, by work: its
        median, and the seconds never falling as work grows (adjacent dips pooled, weighted by calls)."""
        if self._measured is not None:
            return self._measured
        calls: dict[int, list[float]] = {}
        for work, seconds in self._calls:
            calls.setdefault(work, []).append(seconds)
        pools: list[tuple[float, int, list[int]]] = []  # (seconds, calls, works), rising
        for work, times in sorted(calls.items()):
            if len(times) < SAMPLES:
                continue
            pool = (statistics.median(times), len(times), [work])
            while pools and pools[-1][0] > pool[0]:  # a dip: pooled with what it dips below
                (s0, n0, w0), (s1, n1, w1) = pools.pop(), pool
                pool = ((s0 * n0 + s1 * n1) / (n0 + n1), n0 + n1, w0 + w1)
            pools.append(pool)
        self._measured = [(work, seconds) for seconds, _, works in pools for work in works]
        return self._measured

    def seconds(self, work: float) -> float | None:
        """A call of `work`'s predicted seconds, on the segment between the measured works
        around it; None outside what was measured (or before two works were)."""
        points = self.measured()
        if len(points) < 2 or not points[0][0] <= work <= points[-1][0]:
            return None
        works = [w for w, _ in points]
        at = max(bisect.bisect_left(works, work), 1)
        (w0, s0), (w1, s1) = points[at - 1], points[at]
        return s0 + (s1 - s0) * (work - w0) / (w1 - w0)

    def step_seconds(self, jobs: Iterable[Job], max_rows: int) -> float | None:
        """A step of `jobs`' predicted seconds, its calls as the loop makes them: one per image
        size, split into calls of at most `max_rows` rows, and a deterministic request's rows in
        calls of their own. None if any call cannot be predicted."""
        calls: dict[object, tuple[int, int]] = {}  # a call's key → its rows, its work
        for job in jobs:
            per_request = job.rows // max(1, len(job.requests))
            for request in job.requests:
                key = (
                    id(request)
                    if request.deterministic
                    else (request.width, request.height, request.latent_frames)
                )
                rows, work = calls.get(key, (0, 0))
                calls[key] = (rows + per_request, work + work_of(request, per_request))
        total = 0.0
        for rows, work in calls.values():
            split = max(1, math.ceil(rows / max_rows))
            seconds = self.seconds(work / split)
            if seconds is None:
                return None
            total += split * seconds
        return total
