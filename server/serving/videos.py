"""Video jobs run: `VideoRunner` takes queued jobs from the store, a few at once, submits each to
the step loop as any request (it batches with the others, joining their steps at any step, fair
between keys), follows its progress, and writes its content (MP4, frames, thumbnail,
spritesheet) off the step loop.

A job whose run a stopping server cut short goes back to the queue; one a crash cut short runs
again once the store sees its runner gone (`JobStore.recover`). Nobody has to resubmit it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from functools import partial
from typing import Any, TypeVar

from PIL import Image

from server.errors import (
    DeadlineExceeded,
    InvalidRequest,
    OutOfMemory,
    Rejected,
    StepFailed,
    StoreRefused,
    StoreUnavailable,
    Unavailable,
)
from server.media.videos import VARIANTS, Voiced, video_files
from server.requests import GenerationRequest
from server.requests.guidance import parse_guidance
from server.requests.step_cache import StepCache
from server.serving.faults import slow_encode
from server.serving.jobs import Job
from server.serving.sqlitestore import SqliteJobStore
from server.serving.videolease import Lease
from server.serving.videostore import CANCELLED, JobStore, VideoJob, read_whole

log = logging.getLogger("diffshard")

POLL_S = 1.0  # how often an idle runner looks for jobs another process queued
# The API's calls to the store run on threads of their own: a store that hangs (until its socket
# timeout) holds these, never the default executor's, which encode image responses.
STORE_THREADS = 8
# How a run ends that the job itself caused (its size, its steps): it fails. Any other end (the
# replica draining, unhealthy, a helper thread lost) says nothing of the job: it goes back to the
# queue untouched, for this replica once it can take work again or for another one.
JOB_FAULTS = (InvalidRequest, OutOfMemory, DeadlineExceeded, StepFailed)
REQUEST_FIELDS = {f.name for f in fields(GenerationRequest)}
T = TypeVar("T")
REFERENCE = "reference.png"  # an image-to-video job's first frame, stored beside the job
# Jobs a replica runs at once (--max-running-videos). Two is the least that lets a job join
# another's steps, and lets the step loop step one job while the other's video is encoded and
# written; the loop's own admission (its line, --max-batch, the step budget) still decides what
# each step holds. Small, because a claimed job is held: its deadline runs from the claim, its
# decoded frames sit in memory while encoded, and a job this replica holds but its step budget
# cannot fit yet is one another replica sharing the Redis store could be running.
RUNNING_VIDEOS = 2


def open_job_store(url: str, model: str, lease_s: float, *, runs: bool = False) -> JobStore:
    """The store `url` names, holding `model`'s jobs (several models may share one store; each
    takes only its own jobs); `runs`: this process runs them (a SQLite file's model has one such
    server). Fails fast (ConfigError) when it cannot be opened or reached, or is run already."""
    if url.startswith(("redis://", "rediss://")):
        from server.serving.redisstore import RedisJobStore  # the client only where Redis is used

        return RedisJobStore(url, model, lease_s)
    return SqliteJobStore(url, model, runs=runs)


def new_job_id() -> str:
    return f"video_{secrets.token_hex(12)}"


def to_request(job: VideoJob, reference: bytes | None = None) -> GenerationRequest:
    """The generation a job runs (its stored fields: JSON-safe values only; `reference`: the PNG
    stored beside it, an image-to-video's first frame)."""
    values = {k: v for k, v in job.request.items() if k in REQUEST_FIELDS}
    if values.get("step_cache") is not None:
        values["step_cache"] = StepCache(**values["step_cache"])
    if values.get("lora"):
        values["lora"] = tuple(tuple(pair) for pair in values["lora"])
    if values.get("guidance") is not None:
        values["guidance"] = parse_guidance(values["guidance"])
    if reference is None and values.get("reference") is not None:  # a job queued before 0.49: inline
        reference = base64.b64decode(values["reference"])
    if reference is not None:
        values["reference"] = Image.open(io.BytesIO(reference)).convert("RGB")
    return GenerationRequest(**values)


class VideoRunner:
    """One thread taking the store's queued jobs in order while fewer than `max_running` run and
    `takes_work()` says the step loops can take one (ready, not draining, none stuck or slow);
    each job made on a thread of its own, with its own lease, its failure its own. Stopped with
    the server, giving back the jobs it was running. Another thread, on a timer, queues again the
    jobs whose runner died and drops expired content, however busy the others are."""

    def __init__(
        self,
        store: JobStore,
        service: Any,
        *,
        fps: int,
        expiry_s: int,
        max_bytes: int,
        lease_s: float,
        takes_work: Callable[[], bool],
        max_running: int = RUNNING_VIDEOS,
        inject_faults: bool = False,
        clock: Callable[[], float] = time.time,
        notify: Callable[[str, str], None] | None = None,
    ) -> None:
        self.store, self.service, self.fps, self.expiry_s = store, service, fps, expiry_s
        self.max_bytes = max_bytes  # the finished videos' content, in all
        self.lease_s, self.takes_work, self.clock = lease_s, takes_work, clock
        self.max_running = max_running  # jobs made at once
        self.inject_faults = inject_faults  # [[slow-encode]] (serving/faults.py): tests only
        # (event type, job id) into the webhooks' outbox, before the move it announces is stored:
        # a crash between the two leaves an event its deliverer confirms against the store
        self.notify = notify or (lambda kind, job_id: None)
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.seconds_made, self.runs = 0.0, 0  # of video, and runs started, by this replica (metrics)
        # guards the counts above and the jobs being made (their ids), written by the jobs'
        # threads; notified as a job ends (`join` waits for the last)
        self._lock = threading.Condition()
        self._running: dict[str, Job | None] = {}  # job id → its step-loop job, once submitted
        self._wake, self._stopped, self._kept = threading.Event(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="diffshard-videos", daemon=True)
        self._keeper = threading.Thread(target=self._keep, name="diffshard-video-store", daemon=True)
        self._asks = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="diffshard-store")
        store.on_cancel(self._stop_job)  # cancelled by another replica: stopped here at once
        self._keeper.start()
        self._thread.start()

    async def ask(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` (a store read or write of the API's) on the store's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._asks, partial(call, *args))

    def add(
        self,
        job: VideoJob,
        per_owner: int | None = None,
        total: int | None = None,
        reference: bytes | None = None,
    ) -> str | None:
        """Queue `job` (its reference image's PNG beside it) within the bounds (`JobStore.add`):
        None once queued, else the bound it met."""
        if refused := self.store.add(job, per_owner, total, {REFERENCE: reference} if reference else None):
            return refused
        self._wake.set()
        return None

    def cancel(self, job_id: str) -> VideoJob | None:
        """A queued or running job cancelled (`JobStore.cancel`): one this replica runs leaves its
        batch at the next step boundary, its rows and buffers freed then; one another replica
        runs, at that replica's next renewal (each step). The job as it is now; None if none."""
        job = self.store.get(job_id)
        if job is None or job.finished:
            return job
        self.notify("video.failed", job_id)
        job = self.store.cancel(job_id, int(self.clock()) + self.expiry_s)
        self._stop_job(job_id)
        if job is not None and job.error == CANCELLED:
            log.info("video job %s: cancelled", job_id)
        return job

    def _stop_job(self, job_id: str) -> None:
        """A job cancelled in the store, dropped from the step loop at its next step boundary if
        this replica runs it (its rows and buffers freed then)."""
        with self._lock:
            running = self._running.get(job_id)
        if running is not None:
            self.service.cancel(running)

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._asks.shutdown(wait=False, cancel_futures=True)

    def figures(self) -> dict[str, Any]:
        """For the metrics: the store's jobs by state (shared by the replicas of a Redis store;
        None while it does not answer), the seconds of video this replica made and its runs."""
        try:
            jobs = self.store.counts()
        except StoreUnavailable:
            jobs = None
        return {"video_jobs": jobs, "video_seconds": self.seconds_made, "video_runs": self.runs}

    def join(self, timeout_s: float) -> None:
        """Wait for the runner to end (after `stop`, once the service is closed): for the videos
        being encoded and written, up to `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s)
        with self._lock:
            self._lock.wait_for(lambda: not self._running, max(0.0, deadline - time.monotonic()))

    def _keep(self) -> None:
        """Every POLL_S: jobs whose runner is gone queued again (a SQLite file's: those a stopped
        process left, at the first pass, before this runner claims any), expired content dropped."""
        while True:
            try:
                if again := self.store.recover():
                    log.info("video jobs: %d whose runner stopped (a crash?) queued again", again)
                if gone := self.store.tidy(int(self.clock()), self.max_bytes):
                    log.info("video jobs: %d expired or over the store's bytes, deleted", gone)
            except StoreUnavailable:
                log.warning("video jobs: the job store does not answer; trying again in %g s", POLL_S)
            except Exception:  # a bug here must not end the keeper
                log.exception("video jobs: the store's housekeeping failed")
            self._kept.set()
            if self._stopped.wait(POLL_S):
                return

    def _run(self) -> None:
        self._kept.wait()
        while not self._stopped.is_set():
            try:
                self._turn()
            except StoreUnavailable:  # no claim; each running job's lease lapses, for a replica reaching it
                log.warning("video jobs: the job store does not answer; trying again in %g s", POLL_S)
                self._stopped.wait(POLL_S)
            except Exception:  # a bug here must not end the runner
                log.exception("video jobs: the runner's turn failed")
                self._stopped.wait(POLL_S)

    def _turn(self) -> None:
        """Start the next queued job while fewer than `max_running` run, or wait a while: for a job
        to end, one to be queued (here, or by another process: POLL_S)."""
        self._wake.clear()  # a job queued or ended from here on ends the wait below
        with self._lock:
            room = len(self._running) < self.max_running
        job = self.store.claim(self.worker) if room and self.takes_work() else None
        if job is None:
            self._wake.wait(POLL_S)
            return
        if self._stopped.is_set():  # stopped during the claim: nobody here would make it
            self.store.release(job, self.worker)
            return
        with self._lock:
            self.runs += 1
            self._running[job.id] = None
        log.info("video job %s: running (%s)", job.id, self.worker)
        # a thread a job, daemonic as this one: a pool's threads are joined at exit, so an encode
        # would hold the process past `join`'s bound (a job cut short runs again, as after a crash)
        try:
            threading.Thread(target=self._made, args=(job,), name="diffshard-video", daemon=True).start()
        except Exception:  # no thread to be had: back to the queue
            self._ended_job(job.id)
            self.store.release(job, self.worker)
            raise

    def _made(self, job: VideoJob) -> None:
        """`job` made on its own thread: whatever ends it (a bug, the store gone) ends it alone."""
        try:
            try:
                self._make(job, Lease(self.store, job, self.worker, self.lease_s))
            except StoreUnavailable:
                raise
            except Exception:  # a bug making this job: it fails, others run
                log.exception("video job %s", job.id)
                self._fail(job, "the video could not be made")
        except StoreUnavailable:  # its lease lapses: a replica reaching the store runs it
            log.warning(
                "video job %s: the job store does not answer; it runs again once its lease lapses", job.id
            )
        finally:
            self._ended_job(job.id)

    def _ended_job(self, job_id: str) -> None:
        with self._lock:
            self._running.pop(job_id, None)
            self._lock.notify_all()
        self._wake.set()  # room for another

    def _make(self, job: VideoJob, lease: Lease) -> None:
        request = to_request(job, read_whole(self.store.content(job.id, REFERENCE)))
        moved = threading.Event()  # set on the step loop's thread: the store is written here
        try:
            running = self.service.submit(
                [request], request_id=job.id, on_progress=moved.set, owner=job.owner, video=True
            )
        except InvalidRequest as err:
            self._fail(job, str(err))
            return
        except Unavailable as err:  # the line is full, or the loops cannot take work: not the job's doing
            self._give_back(job, err)
            return
        running.future.add_done_callback(lambda _: moved.set())
        with self._lock:
            self._running[job.id] = running
        if (now := self.store.get(job.id)) is not None and now.status != "in_progress":
            running.cancel()  # cancelled between its claim and here: `cancel` found nothing to stop
            return
        while not running.future.done():
            moved.wait(lease.every_s)
            moved.clear()
            done, total = (sum(column) for column in zip(*running.progress(), strict=True))
            job.progress, job.step, job.steps = min(99, 100 * done // max(total, 1)), done, total
            try:
                held = lease.renew()
            except StoreUnavailable:
                running.cancel()  # its lease has lapsed: a replica that reaches the store runs it
                raise
            if not held:  # cancelled, or (its lease lapsed) taken over by another replica
                running.cancel()
                self._let_go(job)
                return
        try:
            frames = running.future.result()[0]
        except JOB_FAULTS as err:
            self._fail(job, str(err))
            return
        except Rejected as err:  # the replica's state (a shutdown, a stuck loop): not the job's
            self._give_back(job, err)
            return
        with lease.kept():  # an encode and a write can outlast the lease
            self._finish(job, frames)

    def _finish(self, job: VideoJob, frames: Any) -> None:
        """Encoded, kept in the store (room made for it within the byte cap), completed."""
        if self.inject_faults:
            slow_encode(job.prompt)
        sound = None
        if isinstance(frames, Voiced):  # a model that makes sound: an AAC stream and a WAV beside
            frames, sound = frames.frames, frames.sound
        content = video_files(frames, self.fps, sound)
        size = sum(len(data) for data in content.values())
        if size > self.max_bytes:  # made room for, it would push out every other job, and not fit
            self._fail(
                job,
                f"the video's content ({size / 2**20:.1f} MiB) is over the store's room for "
                f"videos ({self.max_bytes / 2**20:.1f} MiB, DIFFSHARD_VIDEO_STORE_BYTES): ask for "
                "fewer frames or a smaller size",
            )
            return
        self.store.tidy(int(self.clock()), self.max_bytes - size)  # room for it: the first to expire go
        now = int(self.clock())
        made = replace(
            job,
            status="completed",
            progress=100,
            completed_at=now,
            expires_at=now + self.expiry_s,
            bytes=size,
        )
        self.notify("video.completed", job.id)
        try:
            kept = self.store.finish(made, self.worker, content)
        except StoreRefused as err:  # for its size: made again, it would be refused again
            self._fail(job, str(err))
            return
        if kept:
            with self._lock:
                self.seconds_made += float(job.seconds)
            log.info("video job %s: made (%.1f MiB)", job.id, size / 2**20)
        else:
            self._let_go(job)

    def _let_go(self, job: VideoJob) -> None:
        """Said of a job this runner no longer holds: why (cancelled, or taken over)."""
        now = self.store.get(job.id)
        if now is not None and now.error == CANCELLED:
            log.info("video job %s: cancelled; its run stops", job.id)
        else:
            log.warning("video job %s: taken over by another replica; this run stops", job.id)

    def _give_back(self, job: VideoJob, why: Exception) -> None:
        """Back in the store's queue as it was, for whichever replica can take work next; its place
        here stays taken a while, so this replica does not claim straight back what it cannot run."""
        log.info("video job %s goes back to the queue: %s", job.id, why)
        self.store.release(job, self.worker)
        self._stopped.wait(POLL_S)

    def _fail(self, job: VideoJob, message: str) -> None:
        """Failed, with a message fit for the client; kept until it expires, as a finished one."""
        failed = replace(
            job,
            status="failed",
            error={"code": "video_failed", "message": message},
            expires_at=int(self.clock()) + self.expiry_s,
        )
        self.notify("video.failed", job.id)
        try:
            self.store.finish(failed, self.worker, None)
        except StoreRefused:  # a store that takes no write at all (Redis at maxmemory, noeviction)
            log.error(
                "video job %s: the job store refused even its failure; it runs again once its lease lapses",
                job.id,
            )


__all__ = ["REFERENCE", "VARIANTS", "VideoRunner", "new_job_id", "open_job_store", "to_request"]
