"""The engine loop: step-level continuous batching on one thread, the model's only owner.

At every step boundary the loop
1. admits waiting jobs, first come first served, while the active rows fit `max_batch`
   (a job bigger than that runs alone, its rows split across calls);
2. drops jobs whose client left or whose deadline passed, returning their buffers;
3. runs one batched UNet step per group of same-size requests, each row at its own timestep;
4. decodes the requests whose schedule ended (one VAE call per group) and resolves the jobs
   whose images are all done.

A job is one HTTP request: n images, each its own `RequestState` with its own pool scope.
A job ends exactly once (done, failed, cancelled, expired or drained), and its scopes close
then. The HTTP side only submits jobs and awaits their futures; it never touches torch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from server.pipeline.denoise import GenerationRequest, Pipeline, RequestState, group_states

log = logging.getLogger("diffshard")

FAULT_MARKERS = {"[[fail]]": RuntimeError, "[[oom]]": torch.OutOfMemoryError}
FAULT_STEP = 2  # the step at which a marked request's batch fails


class Rejected(Exception):
    """A job the engine did not finish; `reason` is its stats key."""

    reason = "rejected"


class Overloaded(Rejected):
    reason = "queue_full"

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class Draining(Rejected):
    reason = "draining"


class DeadlineExceeded(Rejected):
    reason = "deadline"


class Cancelled(Rejected):
    reason = "cancelled"


class StepFailed(Rejected):
    reason = "failed"

    def __init__(self, message: str, out_of_memory: bool) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory
        if out_of_memory:
            self.reason = "out_of_memory"


@dataclass(eq=False)
class Job:
    requests: list[GenerationRequest]  # resolved: every field set
    deadline: float  # time.monotonic() past which the job is dropped
    future: Future = field(default_factory=Future)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    submitted: float = field(default_factory=time.monotonic)
    states: list[RequestState] = field(default_factory=list)
    cancel_requested: bool = False

    @property
    def rows(self) -> int:
        return sum(2 if r.guidance_scale > 1 else 1 for r in self.requests)

    def cancel(self) -> None:
        """Drop the job at the next step boundary (the client went away)."""
        self.cancel_requested = True

    def progress(self) -> list[tuple[int, int]]:
        """(steps done, steps in all) per image."""
        if not self.states:
            return [(0, r.steps) for r in self.requests]
        return [(s.index, s.steps) for s in self.states]


ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Distribution:
    """Observations counted into fixed buckets (upper bounds), as a Prometheus histogram keeps them."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bound, not cumulative; the last: above all
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += 1
        self.total += value
        self.count += 1

    def copy(self) -> Distribution:
        return Distribution(self.bounds, list(self.counts), self.total, self.count)


@dataclass
class EngineStats:
    """Plain counters, read by /v1/stats and the metrics collectors."""

    queue_depth: int = 0
    active_jobs: int = 0
    active_images: int = 0
    active_rows: int = 0
    batch_rows: Counter = field(default_factory=Counter)  # rows per call → calls
    rows_per_step: Distribution = field(default_factory=lambda: Distribution(ROW_BUCKETS))
    step_seconds: Distribution = field(default_factory=lambda: Distribution(STEP_BUCKETS))
    queue_wait_seconds: Distribution = field(default_factory=lambda: Distribution(WAIT_BUCKETS))
    jobs_completed: int = 0
    images_completed: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason → jobs
    progress: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # active job → per image

    @property
    def steps(self) -> int:
        """Batched UNet calls."""
        return self.rows_per_step.count

    @property
    def rows_total(self) -> int:
        return int(self.rows_per_step.total)

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue_depth": self.queue_depth,
            "active_jobs": self.active_jobs,
            "active_images": self.active_images,
            "active_rows": self.active_rows,
            "steps": self.steps,
            "step_seconds_total": round(self.step_seconds.total, 6),
            "queue_wait_seconds_total": round(self.queue_wait_seconds.total, 6),
            "rows_total": self.rows_total,
            "batch_rows": {str(rows): calls for rows, calls in sorted(self.batch_rows.items())},
            "jobs_completed": self.jobs_completed,
            "images_completed": self.images_completed,
            "rejected": dict(self.rejected),
            "progress": {job: [list(p) for p in steps] for job, steps in self.progress.items()},
        }


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        max_queue: int = 64,
        max_batch: int = 16,
        inject_faults: bool = False,
    ) -> None:
        self.pipeline = pipeline
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.inject_faults = inject_faults
        self._queue: deque[Job] = deque()
        self._active: list[Job] = []
        self._wake = threading.Condition()  # guards queue, active list and stats (re-entrant lock)
        self._admitting = True
        self._stopping = False
        self._job_seconds: float | None = None  # moving average, for Retry-After
        self._stats = EngineStats()
        self._thread = threading.Thread(target=self._run, name="diffshard-engine", daemon=True)
        self._thread.start()

    # The HTTP side: submit, cancel, read stats, drain.

    def submit(self, requests: Sequence[GenerationRequest], timeout_s: float) -> Job:
        """Queue a job; raises RequestError (bad input), Overloaded or Draining at once."""
        job = Job([self.pipeline.resolve(r) for r in requests], time.monotonic() + timeout_s)
        with self._wake:
            if not self._admitting:
                self._stats.rejected["draining"] += 1
                raise Draining("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                self._stats.rejected["queue_full"] += 1
                raise Overloaded(self.retry_after())
            self._queue.append(job)
            self._wake.notify()
        return job

    def retry_after(self) -> int:
        """Seconds until a queued job would likely get a place: one job's recent duration."""
        return min(120, max(1, math.ceil(self._job_seconds or 5)))

    def cancel(self, job: Job) -> None:
        with self._wake:
            job.cancel()
            self._wake.notify()

    def stats(self) -> EngineStats:
        with self._wake:
            stats = self._stats
            stats.queue_depth = len(self._queue)
            stats.active_jobs = len(self._active)
            stats.active_images = sum(len(j.requests) for j in self._active)
            stats.active_rows = sum(j.rows for j in self._active)
            stats.progress = {j.id: j.progress() for j in self._active}
            return EngineStats(**{name: _copy(value) for name, value in vars(stats).items()})

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is queued or running, or `timeout` passes; True if idle."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._queue or self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
            return True

    def stop_admitting(self) -> None:
        """Refuse new jobs (Draining); those queued or running carry on."""
        with self._wake:
            self._admitting = False

    def close(self) -> None:
        """Stop the loop; jobs still queued or running end with Draining."""
        with self._wake:
            self._admitting, self._stopping = False, True
            self._wake.notify_all()
        self._thread.join()

    # The loop.

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._queue or self._active or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    self._stop()
                    return
                admitted = self._admit()
            try:
                self._iterate(admitted)
            except Exception:  # a bug in the loop itself: fail what is in flight, keep serving
                log.exception("engine loop error")
                try:
                    self._end(list(self._active), StepFailed("internal error in the engine loop", False))
                except Exception:
                    log.exception("engine loop error while failing its requests")
            with self._wake:
                self._wake.notify_all()  # wait_idle() may be waiting

    @property
    def alive(self) -> bool:
        """The loop thread runs (a dead loop would leave every request waiting)."""
        return self._thread.is_alive()

    def _stop(self) -> None:
        """End every job still queued or running (called with the lock held)."""
        self._end(list(self._queue), Draining("the server shut down before this request started"))
        self._queue.clear()
        self._end(list(self._active), Draining("the server shut down before this request finished"))
        self._wake.notify_all()

    def _admit(self) -> list[Job]:
        """Move queued jobs to the active list while their rows fit (called with the lock held);
        they count as active (for stats and drains) from here, before their prompts are encoded."""
        admitted: list[Job] = []
        rows = sum(j.rows for j in self._active)
        while self._queue:
            job = self._queue[0]
            if rows and rows + job.rows > self.max_batch:
                break
            self._queue.popleft()
            admitted.append(job)
            rows += job.rows
        now = time.monotonic()
        for job in admitted:
            self._stats.queue_wait_seconds.observe(now - job.submitted)
        self._active.extend(admitted)
        return admitted

    def _iterate(self, admitted: list[Job]) -> None:
        if admitted:
            self._start(admitted)
        self._drop_leavers()
        for chunk in self._chunks():
            self._step(chunk)
        self._finish()

    def _start(self, admitted: list[Job]) -> None:
        """Encode every admitted job's prompts in one batched call, then open their states."""
        try:
            states = self.pipeline.start([r for job in admitted for r in job.requests])
        except Exception as err:  # the requests were checked at submit: this is the device's doing
            self._fail(admitted, err)
            return
        for job in admitted:
            job.states, states = states[: len(job.requests)], states[len(job.requests) :]

    def _drop_leavers(self) -> None:
        now = time.monotonic()
        with self._wake:
            queued = [j for j in self._queue if j.cancel_requested or now > j.deadline]
            for job in queued:
                self._queue.remove(job)
                self._stats.queue_wait_seconds.observe(now - job.submitted)  # waited, then left
        leaving = queued + [j for j in self._active if j.cancel_requested or now > j.deadline]
        for job in leaving:
            if job.cancel_requested:
                self._end([job], Cancelled("the client disconnected"))
            else:
                self._end([job], DeadlineExceeded("the request ran past its deadline"))

    def _chunks(self) -> Iterable[list[RequestState]]:
        """Running states grouped by size, in calls of at most `max_batch` rows (or one state)."""
        running = [s for job in self._active for s in job.states if not s.done]
        for states in group_states(running):
            chunk: list[RequestState] = []
            for state in states:
                if chunk and sum(s.rows for s in chunk) + state.rows > self.max_batch:
                    yield chunk
                    chunk = []
                chunk.append(state)
            yield chunk

    def _step(self, chunk: list[RequestState]) -> None:
        chunk = [s for s in chunk if not s.closed]  # a job of this chunk may have failed this round
        if not chunk:
            return
        started = time.perf_counter()
        try:
            if self.inject_faults:
                _inject_fault(chunk)
            self.pipeline.step(chunk)
        except Exception as err:
            self._fail(chunk, err)
            return
        seconds, rows = time.perf_counter() - started, sum(s.rows for s in chunk)
        with self._wake:
            stats = self._stats
            stats.step_seconds.observe(seconds)
            stats.batch_rows[rows] += 1
            stats.rows_per_step.observe(rows)

    def _finish(self) -> None:
        ready = [s for j in self._active for s in j.states if s.done and s.image is None and not s.closed]
        for states in group_states(ready):
            try:
                self.pipeline.decode(states)
            except Exception as err:
                self._fail(states, err)
        for job in [j for j in self._active if j.states and all(s.image is not None for s in j.states)]:
            images = [s.image.numpy().copy() for s in job.states]  # copied out before the scopes close
            seconds = time.monotonic() - job.submitted
            self._job_seconds = (
                seconds if self._job_seconds is None else 0.8 * self._job_seconds + 0.2 * seconds
            )
            with self._wake:
                self._stats.jobs_completed += 1
                self._stats.images_completed += len(images)
            self._end([job], images)

    def _fail(self, carrying: list[RequestState] | list[Job], err: Exception) -> None:
        """A start, step or decode raised: fail the jobs it carried, and only those."""
        carried = {id(x) for x in carrying}
        failed = [j for j in self._active if id(j) in carried or any(id(s) in carried for s in j.states)]
        log.error("a batch of %d requests failed: %s: %s", len(failed), type(err).__name__, err)
        self._end(failed, _failure(err))
        if isinstance(err, torch.OutOfMemoryError) and torch.cuda.is_available():
            self.pipeline.pool.clear()
            torch.cuda.empty_cache()

    def _end(self, jobs: list[Job], outcome: list[np.ndarray] | Exception) -> None:
        for job in jobs:
            for state in job.states:
                state.close()
            with self._wake:
                if job in self._active:
                    self._active.remove(job)
            self._resolve(job, outcome)

    def _resolve(self, job: Job, outcome: list[np.ndarray] | Exception) -> None:
        if job.future.done():  # cancelled by its waiter: nobody to tell
            return
        if isinstance(outcome, Exception):
            reason = getattr(outcome, "reason", "invalid" if isinstance(outcome, ValueError) else "failed")
            with self._wake:
                self._stats.rejected[reason] += 1
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)


def _failure(err: Exception) -> StepFailed:
    if isinstance(err, torch.OutOfMemoryError):
        return StepFailed(f"out of device memory during generation: {err}", out_of_memory=True)
    return StepFailed(f"generation failed: {type(err).__name__}", out_of_memory=False)


def _inject_fault(chunk: list[RequestState]) -> None:
    """Testing only (setting inject_faults): a marked prompt makes its batch's step raise, as a
    device fault would; CPU-only machines cannot produce real ones on demand."""
    for state in chunk:
        for marker, error in FAULT_MARKERS.items():
            if marker in state.request.prompt and state.index == FAULT_STEP:
                raise error(f"injected fault {marker}")


def _copy(value: Any) -> Any:
    if isinstance(value, Counter | dict):
        return type(value)(value)
    if isinstance(value, Distribution):
        return value.copy()
    return value
