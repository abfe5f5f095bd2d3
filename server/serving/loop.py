"""The step loop: step-level continuous batching on one thread, the pipeline's only owner.

Every turn of the loop (`_run`)
1. admits waiting jobs, first come first served, while the active rows fit `max_batch`
   (a job bigger than that runs alone, its rows split across calls), and encodes their prompts;
2. drops jobs whose client left or whose deadline passed, returning their buffers;
3. runs one batched denoiser step per group of same-size requests, each row at its own timestep
   (and hands out the partial images due);
4. decodes finished requests (in bounded VAE calls) and resolves jobs whose images are done.

A batched call that raises is retried job by job, so only the job that caused it fails. A job
ends once (done, failed, cancelled, expired or drained), and its scopes close then. A watchdog
answers every waiting job if a call runs past the step timeout, and a dying loop answers them
too. The HTTP side only submits jobs and awaits their futures (and their partial images).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np
import torch

from server.errors import (
    Draining,
    NotReady,
    Overloaded,
    Rejected,
    StepFailed,
)
from server.pipeline import Pipeline, RequestState, group_states
from server.serving.faults import inject_fault
from server.serving.health import Heartbeat, Watchdog, is_out_of_memory
from server.serving.jobs import Job, failure_outcome, leaving_outcome, place_in_line
from server.serving.stats import LoopStats

log = logging.getLogger("diffshard")


class StepLoop:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        max_queue: int = 64,
        max_batch: int = 16,
        step_timeout_s: float = 120.0,
        inject_faults: bool = False,
        on_idle: Callable[[], None] | None = None,
        threads: int | None = None,
        name: str = "diffshard-loop",
    ) -> None:
        self.pipeline = pipeline
        self.threads = threads  # torch intra-op threads of this loop's thread (None: torch's)
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.step_timeout_s = step_timeout_s
        self.inject_faults = inject_faults
        self.on_idle = on_idle  # called when the loop has nothing to do (trim the pool, give memory back)
        self.heartbeat = Heartbeat()
        self.stuck: str | None = None  # set by the watchdog: the loop is wedged in a call
        self._queue: deque[Job] = deque()
        self._active: list[Job] = []
        self._wake = threading.Condition()  # guards queue, active list and stats (re-entrant lock)
        self._admitting = True
        self._stopping = False
        self._closed = threading.Event()
        self._clear_caches = False  # after an out-of-memory error, once its frames are gone
        self._job_seconds: float | None = None  # moving average, for Retry-After
        self._stats = LoopStats()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        Watchdog(self.heartbeat, step_timeout_s, self._on_stuck, self._closed).start()

    # The HTTP side: submit, cancel, read stats, drain.

    def submit(self, job: Job) -> Job:
        """Queue a job of resolved requests; raises Overloaded, Draining or NotReady at once."""
        with self._wake:
            if not self._admitting:
                self._stats.rejected["draining"] += 1
                raise Draining("the server is shutting down")
            if problem := self.problem():
                raise NotReady("unhealthy", problem)
            if len(self._queue) >= self.max_queue:
                self._stats.rejected["queue_full"] += 1
                raise Overloaded(self.retry_after())
            self._queue.append(job)
            job.queue_position = len(self._queue)
            self._wake.notify()
        return job

    def load(self) -> int:
        """Rows queued or running: where the next job waits least."""
        with self._wake:
            return sum(j.rows for j in self._queue) + sum(j.rows for j in self._active)

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

    def problem(self) -> str | None:
        """Why the loop cannot serve (dead, stuck, or its device broken); None when it can."""
        if not self._thread.is_alive():
            return "the step loop stopped; the server log says why"
        if self.stuck:
            return self.stuck
        return self.heartbeat.broken

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
        self._closed.set()  # releases an injected hang
        self._thread.join()

    def abandon(self, error: Rejected) -> None:
        """Answer every queued and running job with `error` now and take no more (the process is
        about to exit; the call in flight, if any, is not waited for)."""
        with self._wake:
            self._admitting = False
            self._answer_all(error)

    # The loop.

    def _run(self) -> None:
        if self.threads is not None:  # a CPU worker's share of the cores
            torch.set_num_threads(self.threads)
        try:
            while self._turn():
                pass
        finally:  # closed, or killed by something no handler caught: nobody may be left waiting
            with self._wake:
                if not self._stopping:
                    log.critical("the step loop died; answering every waiting request 503")
                    self._answer_all(NotReady("unhealthy", "the step loop stopped; the server log says why"))
                self._wake.notify_all()

    def _turn(self) -> bool:
        """One turn of the loop; False when it should stop."""
        with self._wake:
            housekept = self.on_idle is None
            while not (self._queue or self._active or self._stopping):
                if not self._wake.wait(timeout=None if housekept else IDLE_S):
                    self._idle()  # IDLE_S with nothing to do
                    housekept = True
            if self._stopping:
                self._stop()
                return False
            admitted = self._admit()
        if self._clear_caches:
            self._free_device_memory()
        try:
            # 1. Admitted jobs: encode their prompts in one call, open their states.
            if admitted:
                self._isolated(admitted, self._start)
            # 2. Jobs whose client left or whose deadline passed.
            self._drop_leavers()
            # 3. One batched step per group of same-size requests.
            for chunk in self._chunks():
                self._step(chunk)
            for job in self._active:
                job.report()  # the partial images due at this step; its steps done
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
        return True

    def _idle(self) -> None:
        try:
            self.on_idle()
        except Exception:
            log.exception("idle housekeeping failed")

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
            job.queue_position = None
        place_in_line(self._queue)
        self._active.extend(admitted)
        return admitted

    def _start(self, jobs: list[Job]) -> None:
        states = self._call(self.pipeline.start, [r for job in jobs for r in job.requests])
        for job in jobs:
            job.states, states = states[: len(job.requests)], states[len(job.requests) :]

    def _drop_leavers(self) -> None:
        now = time.monotonic()
        with self._wake:
            queued = [j for j in self._queue if j.cancel_requested or now > j.deadline]
            for job in queued:
                self._queue.remove(job)
                self._stats.queue_wait_seconds.observe(now - job.submitted)  # waited, then left
            if queued:
                place_in_line(self._queue)
        for job in queued + [j for j in self._active if j.cancel_requested or now > j.deadline]:
            self._end([job], leaving_outcome(job))

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
        steps_taken = {id(s): s.index for s in chunk}

        def step(jobs: list[Job]) -> None:
            # a retry leaves out states a failed batch already advanced (it raised after them)
            states = [
                s for j in jobs for s in j.states if id(s) in steps_taken and s.index == steps_taken[id(s)]
            ]
            started = time.perf_counter()
            self._call(self.pipeline.step, states)
            seconds, rows = time.perf_counter() - started, sum(s.rows for s in states)
            with self._wake:
                self._stats.step_seconds.observe(seconds)
                self._stats.batch_rows[rows] += 1
                self._stats.rows_per_step.observe(rows)

        self._isolated(self._jobs_of(chunk), step)

    def _finish(self) -> None:
        now = time.monotonic()
        for job in [
            j for j in self._active if j.states and all(s.done for s in j.states) and now > j.deadline
        ]:
            self._end([job], leaving_outcome(job))  # not worth decoding: nobody will take it
        ready = [s for j in self._active for s in j.states if s.done and s.image is None and not s.closed]
        for states in group_states(ready):
            self._isolated(self._jobs_of(states), lambda jobs, states=states: self._decode(jobs, states))
        for job in [j for j in self._active if j.states and all(s.image is not None for s in j.states)]:
            images = [s.image.numpy().copy() for s in job.states]  # copied out before the scopes close
            seconds, average = time.monotonic() - job.submitted, self._job_seconds
            self._job_seconds = seconds if average is None else 0.8 * average + 0.2 * seconds
            with self._wake:
                self._stats.jobs_completed += 1
                self._stats.images_completed += len(images)
            self._end([job], images)

    def _decode(self, jobs: list[Job], states: list[RequestState]) -> None:
        mine = {id(s) for j in jobs for s in j.states}
        self._call(self.pipeline.decode, [s for s in states if id(s) in mine])

    # Calls into the pipeline: timed by the heartbeat, faults injected, failures kept to their job.

    def _call(self, method: Callable, arg: list) -> list:
        self.heartbeat.begin()
        try:
            if self.inject_faults:
                inject_fault(method.__name__, arg, self._closed)
            result = method(arg)
            self.pipeline.synchronize()  # so step times are device times, not enqueue times
        finally:
            self.heartbeat.end()
        self.heartbeat.succeeded()
        return result

    def _isolated(self, jobs: list[Job], run: Callable[[list[Job]], None]) -> None:
        """`run` on all jobs at once; if it raises, on each job alone, so only the culprit fails."""
        jobs = [j for j in jobs if j in self._active]  # one may have failed earlier this turn
        if not jobs:
            return
        try:
            run(jobs)
            return
        except Exception as err:
            if len(jobs) == 1:
                self._fail(jobs, err)
                return
            failed = f"a batched call of {len(jobs)} requests failed ({type(err).__name__})"
            log.warning("%s; retrying them one by one", failed)
        for job in jobs:
            try:
                run([job])
            except Exception as err:
                self._fail([job], err)

    def _jobs_of(self, states: list[RequestState]) -> list[Job]:
        ids = {id(s) for s in states}
        return [j for j in self._active if any(id(s) in ids for s in j.states)]

    def _fail(self, jobs: list[Job], err: Exception) -> None:
        self.heartbeat.failed(err)
        ids = ", ".join(j.id for j in jobs)
        trace = None if is_out_of_memory(err) else err  # an OOM's traceback says nothing new
        log.error("request %s failed: %s: %s", ids, type(err).__name__, err, exc_info=trace)
        self._end(jobs, failure_outcome(err))
        if is_out_of_memory(err):
            self._clear_caches = True  # at the next turn, when this error's frames are gone

    def _free_device_memory(self) -> None:
        self._clear_caches = False
        self.pipeline.pool.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _end(self, jobs: list[Job], outcome: list[np.ndarray] | Rejected) -> None:
        for job in jobs:
            for state in job.states:
                state.close()
            with self._wake:
                if job in self._active:
                    self._active.remove(job)
            self._resolve(job, outcome)

    def _resolve(self, job: Job, outcome: list[np.ndarray] | Rejected) -> None:
        with self._wake:
            if job.future.done():  # cancelled by its waiter, or answered by the watchdog
                return
            if isinstance(outcome, Rejected):
                self._stats.rejected[outcome.reason] += 1
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

    def _answer_all(self, error: Rejected) -> None:
        """Answer every queued and running job now, without touching their buffers (a wedged call
        may still be using them); called with the lock held."""
        for job in [*self._queue, *self._active]:
            self._resolve(job, error)

    def _on_stuck(self, running_s: float) -> None:
        self.stuck = f"the step loop is stuck: a call has run for {running_s:.0f} s"
        log.critical("%s (DIFFSHARD_STEP_TIMEOUT_S); answering every waiting request 503", self.stuck)
        with self._wake:
            self._answer_all(NotReady("unhealthy", self.stuck))


IDLE_S = 30.0  # the loop does its housekeeping after this long with nothing to do
