"""The step loop: step-level continuous batching on one thread, the pipeline's only owner.

Every turn of the loop (`_run`)
1. admits waiting jobs, first come first served, while the active rows fit `max_batch`
   (a job bigger than that runs alone, its rows split across calls), and encodes their prompts;
2. drops jobs whose client left or whose deadline passed, returning their buffers;
3. runs one batched denoiser step per group of same-size requests, each row at its own timestep;
4. decodes the requests whose schedule ended (one VAE call per group) and resolves the jobs
   whose images are all done.

A job ends exactly once (done, failed, cancelled, expired or drained), and its scopes close
then. The HTTP side only submits jobs and awaits their futures; it never touches torch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable

import numpy as np
import torch

from server.errors import (
    Cancelled,
    DeadlineExceeded,
    Draining,
    OutOfMemory,
    Overloaded,
    Rejected,
    StepFailed,
)
from server.pipeline import Pipeline, RequestState, group_states
from server.serving.jobs import Job
from server.serving.stats import LoopStats

log = logging.getLogger("diffshard")

FAULT_MARKERS = {"[[fail]]": RuntimeError, "[[oom]]": torch.OutOfMemoryError}
FAULT_STEP = 2  # the step at which a marked request's batch fails


class StepLoop:
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
        self._stats = LoopStats()
        self._thread = threading.Thread(target=self._run, name="diffshard-loop", daemon=True)
        self._thread.start()

    # The HTTP side: submit, cancel, read stats, drain.

    def submit(self, job: Job) -> Job:
        """Queue a job of resolved requests; raises Overloaded or Draining at once."""
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

    def stats(self) -> LoopStats:
        with self._wake:
            stats = self._stats
            stats.queue_depth = len(self._queue)
            stats.active_jobs = len(self._active)
            stats.active_images = sum(len(j.requests) for j in self._active)
            stats.active_rows = sum(j.rows for j in self._active)
            stats.progress = {j.id: j.progress() for j in self._active}
            return stats.copy()

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

    @property
    def alive(self) -> bool:
        """The loop thread runs (a dead loop would leave every request waiting)."""
        return self._thread.is_alive()

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
                # 1. Admitted jobs: encode their prompts in one call, open their states.
                if admitted:
                    self._start(admitted)
                # 2. Jobs whose client left or whose deadline passed.
                self._drop_leavers()
                # 3. One batched step per group of same-size requests.
                for chunk in self._chunks():
                    self._step(chunk)
                # 4. Decode what finished; resolve the jobs whose images are all done.
                self._finish()
            except Exception:  # a bug in the loop itself: fail what is in flight, keep serving
                log.exception("step loop error")
                try:
                    self._end(list(self._active), StepFailed("internal error in the step loop"))
                except Exception:
                    log.exception("step loop error while failing its requests")
            with self._wake:
                self._wake.notify_all()  # wait_idle() may be waiting

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

    def _start(self, admitted: list[Job]) -> None:
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
                message = (
                    f"the request ran past its deadline: {job.timeout_s:g} s (DIFFSHARD_REQUEST_TIMEOUT_S)"
                )
                self._end([job], DeadlineExceeded(message))

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
            self._stats.step_seconds.observe(seconds)
            self._stats.batch_rows[rows] += 1
            self._stats.rows_per_step.observe(rows)

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

    def _end(self, jobs: list[Job], outcome: list[np.ndarray] | Rejected) -> None:
        for job in jobs:
            for state in job.states:
                state.close()
            with self._wake:
                if job in self._active:
                    self._active.remove(job)
            if job.future.done():  # cancelled by its waiter: nobody to tell
                continue
            if isinstance(outcome, Rejected):
                with self._wake:
                    self._stats.rejected[outcome.reason] += 1
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)


def _failure(err: Exception) -> Rejected:
    if isinstance(err, torch.OutOfMemoryError):
        return OutOfMemory(f"out of device memory during generation: {err}")
    return StepFailed(f"generation failed: {type(err).__name__}")


def _inject_fault(chunk: list[RequestState]) -> None:
    """Testing only (setting inject_faults): a marked prompt makes its batch's step raise, as a
    device fault would; CPU-only machines cannot produce real ones on demand."""
    for state in chunk:
        for marker, error in FAULT_MARKERS.items():
            if marker in state.request.prompt and state.index == FAULT_STEP:
                raise error(f"injected fault {marker}")
