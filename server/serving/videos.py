"""Video jobs run: `VideoRunner` takes queued jobs from the store one at a time, submits each to
the step loop as any request (it batches with the others, fair between keys), follows its
progress, and writes its content (MP4, frames, thumbnail, spritesheet) off the step loop.

A job whose run a stopping server cut short goes back to the queue; one a crash cut short runs
again once the store sees its runner gone (`JobStore.recover`). Nobody has to resubmit it.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from PIL import Image

from server.errors import (
    DeadlineExceeded,
    InvalidRequest,
    OutOfMemory,
    Rejected,
    StepFailed,
    StoreUnavailable,
    Unavailable,
)
from server.pipeline import GenerationRequest
from server.pipeline.stepcache import StepCache
from server.pipeline.videofiles import VARIANTS, video_files
from server.serving.sqlitestore import SqliteJobStore
from server.serving.videostore import JobStore, VideoJob

log = logging.getLogger("diffshard")

POLL_S = 1.0  # how often an idle runner looks for jobs another process queued
# How a run ends that the job itself caused (its size, its steps): it fails. Any other end (the
# replica draining, unhealthy, a helper thread lost) says nothing of the job: it goes back to the
# queue untouched, for this replica once it can take work again or for another one.
JOB_FAULTS = (InvalidRequest, OutOfMemory, DeadlineExceeded, StepFailed)
REQUEST_FIELDS = {f.name for f in fields(GenerationRequest)}


def open_job_store(url: str, model: str, lease_s: float) -> JobStore:
    """The store `url` names, holding `model`'s jobs (several models may share one Redis; each
    takes only its own jobs). Fails fast (ConfigError) when it cannot be opened or reached."""
    if url.startswith(("redis://", "rediss://")):
        from server.serving.redisstore import RedisJobStore  # the client only where Redis is used

        return RedisJobStore(url, model, lease_s)
    return SqliteJobStore(url, model)


def new_job_id() -> str:
    return f"video_{secrets.token_hex(12)}"


def to_request(job: VideoJob) -> GenerationRequest:
    """The generation a job runs (its stored fields: JSON-safe values only)."""
    values = {k: v for k, v in job.request.items() if k in REQUEST_FIELDS}
    if values.get("step_cache") is not None:
        values["step_cache"] = StepCache(**values["step_cache"])
    if values.get("lora"):
        values["lora"] = tuple(tuple(pair) for pair in values["lora"])
    if values.get("reference") is not None:  # image-to-video's first frame: a PNG we wrote, base64
        values["reference"] = Image.open(io.BytesIO(base64.b64decode(values["reference"]))).convert("RGB")
    return GenerationRequest(**values)


class VideoRunner:
    """One thread taking the store's queued jobs in order, while `takes_work()` says the step
    loops can take one (ready, not draining, none stuck or slow); stopped with the server, giving
    back the job it was running."""

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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.service, self.fps, self.expiry_s = store, service, fps, expiry_s
        self.max_bytes = max_bytes  # the finished videos' content, in all
        self.renew_s = lease_s / 3  # a running job's lease is renewed this often, and at each step
        self.takes_work, self.clock = takes_work, clock
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.seconds_made = 0.0  # of video, by this replica (a metric)
        self._wake, self._stopped = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="diffshard-videos", daemon=True)
        self._thread.start()

    def add(self, job: VideoJob, per_owner: int | None = None, total: int | None = None) -> str | None:
        """Queue `job` within the bounds (`JobStore.add`): None once queued, else the bound it met."""
        if refused := self.store.add(job, per_owner, total):
            return refused
        self._wake.set()
        return None

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def figures(self) -> dict[str, Any]:
        """For the metrics: the store's jobs by state (shared by the replicas of a Redis store;
        None while it does not answer) and the seconds of video this replica made."""
        try:
            jobs = self.store.counts()
        except StoreUnavailable:
            jobs = None
        return {"video_jobs": jobs, "video_seconds": self.seconds_made}

    def join(self, timeout_s: float) -> None:
        """Wait for the runner to end (after `stop`, once the service is closed)."""
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._turn()
            except StoreUnavailable:  # a running job's lease lapses: a replica reaching the store runs it
                log.warning("video jobs: the job store does not answer; trying again in %g s", POLL_S)
                self._stopped.wait(POLL_S)
            except Exception:  # a bug here must not end the runner
                log.exception("video jobs: the runner's turn failed")
                self._stopped.wait(POLL_S)

    def _turn(self) -> None:
        """Run the next queued job, or idle a while when there is none."""
        job = self.store.claim(self.worker) if self.takes_work() else None
        if job is None:
            self._idle()
            return
        try:
            self._make(job)
        except StoreUnavailable:
            raise
        except Exception:  # a bug making this job: it fails, others run
            log.exception("video job %s", job.id)
            self._fail(job, "the video could not be made")

    def _idle(self) -> None:
        """Between jobs: take back jobs whose runner is gone, drop expired content, then wait
        for a job added here or a while (another process may queue one)."""
        if again := self.store.recover():
            log.info("video jobs: %d whose run stopped (a crash or a lost replica) queued again", again)
        if gone := self.store.tidy(int(self.clock()), self.max_bytes):
            log.info("video jobs: %d expired or over the store's bytes, deleted", gone)
        self._wake.wait(POLL_S)
        self._wake.clear()

    def _make(self, job: VideoJob) -> None:
        request = to_request(job)
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
        while not running.future.done():
            moved.wait(self.renew_s)
            moved.clear()
            done, total = (sum(column) for column in zip(*running.progress(), strict=True))
            job.progress, job.step, job.steps = min(99, 100 * done // max(total, 1)), done, total
            try:
                held = self.store.progress(job, self.worker)  # and the lease renewed
            except StoreUnavailable:
                running.cancel()  # its lease will lapse: a replica that reaches the store runs it
                raise
            if not held:  # its lease lapsed: another replica runs it
                log.warning("video job %s: taken over by another replica; this run stops", job.id)
                running.cancel()
                return
        try:
            frames = running.future.result()[0]
        except JOB_FAULTS as err:
            self._fail(job, str(err))
            return
        except Rejected as err:  # the replica's state (a shutdown, a stuck loop): not the job's
            self._give_back(job, err)
            return
        content = video_files(frames, self.fps)
        job.bytes = sum(len(data) for data in content.values())
        self.store.tidy(int(self.clock()), self.max_bytes - job.bytes)  # room for it: the oldest go first
        job.status, job.progress, job.completed_at = "completed", 100, int(self.clock())
        job.expires_at = job.completed_at + self.expiry_s
        if self.store.finish(job, self.worker, content):
            self.seconds_made += float(job.seconds)
        else:
            log.warning("video job %s: another replica took it over and made it too", job.id)

    def _give_back(self, job: VideoJob, why: Exception) -> None:
        """Back in the store's queue as it was, for whichever replica can take work next; this one
        waits a while before it looks again (it claims only once its loops take work)."""
        log.info("video job %s goes back to the queue: %s", job.id, why)
        self.store.release(job, self.worker)
        self._stopped.wait(POLL_S)

    def _fail(self, job: VideoJob, message: str) -> None:
        """Failed, with a message fit for the client; kept until it expires, as a finished one."""
        job.status, job.error = "failed", {"code": "video_failed", "message": message}
        job.expires_at = int(self.clock()) + self.expiry_s
        self.store.finish(job, self.worker, None)


__all__ = ["VARIANTS", "VideoRunner", "new_job_id", "open_job_store", "to_request"]
