"""The step loop: step-level continuous batching on one thread, the pipeline's only owner.

Every turn of the loop (`_turn`)
1. drops jobs whose client left, whose deadline passed or the watchdog answered (their buffers back);
2. picks the jobs to step (`Lineup.pick`: owners by deficit round robin, every row of
   `max_batch` and the step budget taken while any owner has work; a job bigger than that runs
   alone, its rows split across calls; background jobs only where they slow interactive ones by
   little, as this loop's measured calls predict: `StepCosts`), admitting waiting ones, and
   encodes their prompts;
3. runs one batched denoiser step per group of same-size requests, each row at its own timestep
   (a `deterministic` request's rows in a call of their own), and hands out the partial images due;
4. decodes finished requests (in bounded VAE calls) and resolves jobs whose images are done.

A batched call that raises is retried job by job, so only the job that caused it fails. A job
ends once (done, failed, cancelled, expired or drained), and its scopes close then. Each call
has a deadline scaled by its work (`health.py`): past it the loop is slow (not ready), far past
it stuck (not live, every waiting job answered); a call that returns clears both. A dying loop
answers every waiting job too; a helper thread that died is replaced after the turn. The HTTP
side only submits jobs and awaits their futures (and their partial images).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from server.engine.hardware.threads import take_thread
from server.errors import Draining, KeyOverloaded, NotReady, Overloaded, Rejected, StepFailed
from server.media.videos import Soundtrack, Voiced
from server.pipeline import Pipeline
from server.pipeline.steps.state import RequestState, group_states
from server.serving.activity import Activity
from server.serving.calls import WatchedCalls
from server.serving.health import is_out_of_memory
from server.serving.jobs import BACKGROUND, INTERACTIVE, PRIORITIES, Job, failure_outcome, leaving_outcome
from server.serving.lineup import Lineup, Room
from server.serving.stats import LoopStats
from server.serving.stepcosts import StepCosts, work_of

log = logging.getLogger("diffshard")

# Background jobs a loop may hold, as a multiple of its interactive bounds (when not given): they
# wait for rows nobody else wants, so a batch's lines wait here rather than at its runner.
BACKGROUND_QUEUE_FACTOR = 4


class StepLoop:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        max_queue: int = 64,
        max_queue_per_key: int | None = None,
        max_background_queue: int | None = None,
        max_batch: int = 16,
        step_budget: float | None = None,
        step_timeout_s: float = 120.0,
        native_pixels: int = 1,
        inject_faults: bool = False,
        threads: int | None = None,
        name: str = "diffshard-loop",
    ) -> None:
        self.pipeline = pipeline
        self.threads = threads  # torch intra-op threads of this loop's thread (None: torch's)
        self.max_queue = max_queue
        self.max_queue_per_key = max_queue_per_key or max_queue  # jobs one API key may have waiting
        # Background jobs count against bounds of their own, never the interactive ones.
        self.max_background_queue = max_background_queue or BACKGROUND_QUEUE_FACTOR * max_queue
        self.max_background_queue_per_key = math.ceil(
            self.max_background_queue * self.max_queue_per_key / max(1, max_queue)
        )
        self.max_batch = max_batch
        # Work a step may take, in pixel-rows: `step_budget` rows of the native size (None: no bound).
        self.max_work = step_budget * native_pixels if step_budget is not None else math.inf
        self.activity = Activity()  # since when it has had no work
        self._lineup = Lineup()
        self._active: list[Job] = []  # admitted: their states are open (some may be parked)
        self._wake = threading.Condition()  # guards line, active list and stats (re-entrant lock)
        self._admitting = True
        self._stopping = False
        self._closed = threading.Event()
        self._clear_caches = False  # after an out-of-memory error, once its frames are gone
        # An interactive job's seconds, moving average: for Retry-After, and how long interactive
        # work may pause between requests (a background job's wait says nothing of either).
        self._job_seconds: float | None = None
        self._stats = LoopStats()
        self._costs = StepCosts()  # this loop's denoiser calls, timed: where background rows fit
        self._interactive_at: float | None = None  # time.monotonic() interactive work was last here
        self._call = WatchedCalls(
            pipeline,
            step_timeout_s=step_timeout_s,
            max_batch=max_batch,
            native_pixels=native_pixels,
            inject_faults=inject_faults,
            closed=self._closed,
            on_stuck=self._answer_stuck,
        )
        self.heartbeat = self._call.heartbeat
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # The HTTP side: submit, cancel, read stats, drain.

    def submit(self, job: Job) -> Job:
        """Queue a job of resolved requests; raises Overloaded, Draining or NotReady at once."""
        with self._wake:
            if not self._admitting:
                self._stats.rejected["draining"] += 1
                raise Draining("the server is shutting down")
            if problem := self.problem():
                raise NotReady("unhealthy", problem)
            background = job.priority == BACKGROUND
            bound = self.max_background_queue if background else self.max_queue
            per_key = self.max_background_queue_per_key if background else self.max_queue_per_key
            if self._lineup.count(job.priority) >= bound:
                self._stats.rejected["queue_full"] += 1
                raise Overloaded(self.retry_after())
            if job.owner is not None and self._lineup.waiting(job.owner, job.priority) >= per_key:
                self._stats.rejected["key_queue_full"] += 1
                raise KeyOverloaded(self.retry_after(), per_key)
            self._lineup.append(job)
            self.activity.working(True)
            self._wake.notify()
        return job

    def load(self, priority: str = BACKGROUND) -> int:
        """Rows queued or running of `priority` and the classes before it: where the next job of
        that class waits least (background rows give way to an interactive job)."""
        classes = PRIORITIES[: PRIORITIES.index(priority) + 1]
        with self._wake:
            return sum(j.rows for j in [*self._lineup, *self._active] if j.priority in classes)

    def retry_after(self) -> int:
        """Seconds until a queued job would likely get a place: an interactive job's recent duration."""
        return min(120, max(1, math.ceil(self._job_seconds or 5)))

    def cancel(self, job: Job) -> None:
        with self._wake:
            job.cancel()
            self._wake.notify()

    def stats(self) -> LoopStats:
        with self._wake:
            stats = self._stats
            stats.queue_depth = len(self._lineup)
            stats.active_jobs = len(self._active)
            stats.active_images = sum(len(j.requests) for j in self._active)
            stats.active_rows = sum(j.rows for j in self._active)
            stats.progress = {j.id: j.progress() for j in self._active}
            stats.owners = {j.id: j.owner for j in [*self._active, *self._lineup]}
            stats.queue_depth_by_priority = Counter(j.priority for j in self._lineup)
            stats.active_rows_by_priority = Counter()
            for job in self._active:
                stats.active_rows_by_priority[job.priority] += job.rows
            self._call.count_into(stats)
            stats.cached_bytes = sum(s.cache.nbytes for j in self._active for s in j.states if not s.closed)
            return stats.copy()

    def problem(self) -> str | None:
        """Why the loop cannot serve at all (dead, stuck, or its device broken); None when it can.
        A slow loop still serves (`slow` says why it is not ready for more)."""
        if not self._thread.is_alive():
            return "the step loop stopped; the server log says why"
        return self._call.stuck or self.heartbeat.broken

    @property
    def slow(self) -> str | None:
        """Why the loop should get no more work for now (a call past its deadline); None if not."""
        return self._call.slow

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is queued or running, or `timeout` passes; True if idle."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._lineup or self._active:
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
        self._thread.join(2 * self._call.step_timeout_s)  # past it a call is stuck: its daemon thread is left

    def abandon(self, error: Rejected) -> None:
        """Answer every queued and running job with `error` now and take no more (the process is
        about to exit; the call in flight, if any, is not waited for)."""
        with self._wake:
            self._admitting = False
            self._answer_all(error)

    # The loop.

    def _run(self) -> None:
        take_thread(self.threads, self.pipeline.device)  # its share of the cores, its lane's GPU
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
            while not (self._lineup or self._active or self._stopping):
                self.activity.working(False)  # housekeeping and a background compile may start
                self._wake.wait()
            if self._stopping:
                self._stop()
                return False
            self.activity.working(True)
            # 1. Leavers first: they take no place and no encoding.
            self._drop_leavers()
            # 2. Who steps this turn, and who is admitted to (the rest of the admitted are parked).
            running, admitted = self._lineup.pick(self._active, self.max_batch, self.max_work, self._room())
            self._admitted(admitted)
        if self._clear_caches:
            self._free_device_memory()
        try:
            if admitted:  # their prompts, encoded in one call (a deterministic job's alone)
                for jobs in self._alike(admitted):
                    self._isolated(jobs, self._start)
            # 3. One batched step per group of same-size requests (parked jobs wait a turn).
            for chunk in self._chunks(running + admitted):
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
        self.pipeline.lane.recover()  # a helper thread that died: replaced before the next turn
        with self._wake:
            self._wake.notify_all()  # wait_idle() may be waiting
        return True

    def _stop(self) -> None:
        """End every job still queued or running (called with the lock held)."""
        self._end(self._lineup.drain(), Draining("the server shut down before this request started"))
        self._end(list(self._active), Draining("the server shut down before this request finished"))
        self._wake.notify_all()

    def _room(self) -> Room:
        """What background work may take this turn: this loop's measured calls, and whether
        interactive work has been away longer than an interactive job takes (its clients have
        stopped sending, not paused between two requests); called with the lock held."""
        now = time.monotonic()
        if self._lineup.count(INTERACTIVE) or any(j.priority == INTERACTIVE for j in self._active):
            self._interactive_at = now
        away = math.inf if self._interactive_at is None else now - self._interactive_at
        return Room(self._costs, calm=away > (self._job_seconds or 0.0))

    def _admitted(self, jobs: list[Job]) -> None:
        """Jobs that leave the line: they count as active (for stats and drains) from here,
        before their prompts are encoded (called with the lock held)."""
        now = time.monotonic()
        for job in jobs:
            self._stats.queue_wait_seconds.observe(now - job.submitted)
            self._stats.adapter_requests.update({name for r in job.requests for name, _ in r.lora})
            self._stats.images_by_kind.update(r.kind for r in job.requests)
            job.queue_position = None
        self._active.extend(jobs)

    def _drop_leavers(self) -> None:
        """End the jobs, waiting or admitted, whose client left, whose deadline passed or that
        the watchdog already answered (called with the lock held)."""
        now = time.monotonic()

        def leaving(job: Job) -> bool:
            return job.cancel_requested or now > job.deadline or job.future.done()

        waiting = [j for j in self._lineup if leaving(j)]
        self._lineup.remove(waiting)
        for job in waiting:
            self._stats.queue_wait_seconds.observe(now - job.submitted)  # waited, then left
        for job in waiting + [j for j in self._active if leaving(j)]:
            self._end([job], leaving_outcome(job))

    @staticmethod
    def _alike(jobs: list[Job]) -> list[list[Job]]:
        """Jobs that may share a call: every plain job together, each deterministic one alone."""
        plain = [j for j in jobs if not j.deterministic]
        return ([plain] if plain else []) + [[j] for j in jobs if j.deterministic]

    def _start(self, jobs: list[Job]) -> None:
        states = self._call(self.pipeline.start, [r for job in jobs for r in job.requests])
        for job in jobs:
            job.states, states = states[: len(job.requests)], states[len(job.requests) :]

    def _chunks(self, jobs: list[Job]) -> Iterable[list[RequestState]]:
        """The states of `jobs` still denoising, grouped by size, in calls of at most `max_batch`
        rows (or one state); a deterministic request's states each in a call of their own."""
        running = [s for job in jobs for s in job.states if not s.done and job in self._active]
        yield from ([s] for s in running if s.request.deterministic)
        for states in group_states([s for s in running if not s.request.deterministic]):
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
                self._costs.observe(sum(work_of(s.request, s.rows) for s in states), seconds)
                self._stats.step_seconds.observe(seconds)
                self._stats.batch_rows[rows] += 1
                self._stats.rows_per_step.observe(rows)
                self._stats.count_rows(states)
                priority = {id(s): j.priority for j in jobs for s in j.states}
                for state in states:
                    self._stats.rows_by_priority[priority[id(state)]] += state.rows

        self._isolated(self._jobs_of(chunk), step)

    def _finish(self) -> None:
        now = time.monotonic()
        for job in [
            j for j in self._active if j.states and all(s.done for s in j.states) and now > j.deadline
        ]:
            self._end([job], leaving_outcome(job))  # not worth decoding: nobody will take it
        ready = [s for j in self._active for s in j.states if s.done and s.image is None and not s.closed]
        alone = [[s] for s in ready if s.request.deterministic]
        for states in alone + group_states([s for s in ready if not s.request.deterministic]):
            self._isolated(self._jobs_of(states), lambda jobs, states=states: self._decode(jobs, states))
        for job in [j for j in self._active if j.states and all(s.image is not None for s in j.states)]:
            images = [self._made(s) for s in job.states]  # copied out before the scopes close
            seconds, average = time.monotonic() - job.submitted, self._job_seconds
            if job.priority == INTERACTIVE:
                self._job_seconds = seconds if average is None else 0.8 * average + 0.2 * seconds
            with self._wake:
                self._stats.jobs_completed += 1
                self._stats.images_completed += len(images)
            self._end([job], images)

    def _made(self, state: RequestState) -> Any:
        """A finished state's image or video ([F, H, W, 3]); a video with its sound: `Voiced`."""
        frames = state.image.numpy().copy()
        if state.sound is None or state.request.frames is None:
            return frames
        return Voiced(frames, Soundtrack(state.sound.numpy().copy(), self.pipeline.family.sample_rate()))

    def _decode(self, jobs: list[Job], states: list[RequestState]) -> None:
        mine = {id(s) for j in jobs for s in j.states}
        self._call(self.pipeline.decode, [s for s in states if id(s) in mine])

    # Calls into the pipeline: timed by the heartbeat, faults injected, failures kept to their job.

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
            log.warning("a batch of %d jobs failed (%s); retrying each alone", len(jobs), type(err).__name__)
            self._clear_caches |= is_out_of_memory(err)
        if self._clear_caches:  # out of the handler, its frames' tensors gone: free them before retries
            self._free_device_memory()
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
        self._clear_caches |= is_out_of_memory(err)  # cleared next turn, once this error's frames are gone

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
        may still be using them; the loop drops them once it runs again); called with the lock held."""
        for job in [*self._lineup, *self._active]:
            self._resolve(job, error)

    def _answer_stuck(self, why: str) -> None:
        with self._wake:
            self._answer_all(NotReady("unhealthy", why))
