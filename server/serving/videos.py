"""Video jobs run: `VideoRunner` takes queued jobs from the store one at a time, submits each to
the step loop as any request (it batches with the others, fair between keys), follows its
progress, and writes its content (MP4, frames, thumbnail, spritesheet) off the step loop.

A job whose run a stopping server cut short stays `in_progress` in the store: the next start
queues it again (`SqliteJobStore.requeue`) and it runs without being resubmitted.
"""

from __future__ import annotations

import base64
import io
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from PIL import Image

from server.errors import InvalidRequest, Overloaded, Rejected
from server.pipeline import GenerationRequest
from server.pipeline.stepcache import StepCache
from server.pipeline.videofiles import VARIANTS, write_video_files
from server.serving.videostore import SqliteJobStore, VideoJob

log = logging.getLogger("diffshard")

POLL_S = 1.0  # how often an idle runner looks for jobs another process queued
REQUEST_FIELDS = {f.name for f in fields(GenerationRequest)}


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
    """One thread taking the store's queued jobs in order, while `serving()` says the server
    takes work; stopped with the server."""

    def __init__(
        self,
        store: SqliteJobStore,
        service: Any,
        *,
        fps: int,
        expiry_s: int,
        max_bytes: int,
        serving: Callable[[], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.service, self.fps, self.expiry_s = store, service, fps, expiry_s
        self.max_bytes = max_bytes  # the finished videos' content, in all
        self.serving, self.clock = serving, clock
        self._wake, self._stopped = threading.Event(), threading.Event()
        again = store.requeue()
        if again:
            log.info("video jobs: %d left in progress by the last run queued again", again)
        self._thread = threading.Thread(target=self._run, name="diffshard-videos", daemon=True)
        self._thread.start()

    def add(self, job: VideoJob) -> None:
        self.store.add(job)
        self._wake.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            job = self.store.claim() if self.serving() else None
            if job is None:
                if gone := self.store.tidy(int(self.clock()), self.max_bytes):
                    log.info("video jobs: %d expired or over the store's bytes, deleted", gone)
                self._wake.wait(POLL_S)
                self._wake.clear()
                continue
            try:
                self._make(job)
            except Exception:  # a bug here must not end the runner: the job fails, others run
                log.exception("video job %s", job.id)
                self._fail(job, "the video could not be made")

    def _make(self, job: VideoJob) -> None:
        request = to_request(job)

        running: list[Any] = []  # the step loop's job, once submit returned

        def moved() -> None:  # on the step loop's thread: steps done, in percent
            if not running:  # the loop may report before submit has returned
                return
            done = sum(d for d, _ in running[0].progress())
            total = sum(t for _, t in running[0].progress()) or 1
            percent = min(99, 100 * done // total)
            if percent != job.progress:
                job.progress = percent
                self.store.save(job)

        try:
            running.append(
                self.service.submit([request], request_id=job.id, on_progress=moved, owner=job.owner)
            )
            frames = running[0].future.result()[0]
        except InvalidRequest as err:
            self._fail(job, str(err))
            return
        except Overloaded:  # the line is full: back in the store's queue, taken again later
            job.status = "queued"
            self.store.save(job)
            self._stopped.wait(POLL_S)
            return
        except Rejected as err:
            if not self.serving():  # the server is stopping: the job runs again at the next start
                log.info("video job %s interrupted by the shutdown: it runs again at the next start", job.id)
                return
            self._fail(job, str(err))
            return
        job.bytes = write_video_files(frames, self.store.folder(job.id), self.fps)
        self.store.tidy(int(self.clock()), self.max_bytes)  # room for it: the oldest go first
        now = int(self.clock())
        job.status, job.progress, job.completed_at, job.expires_at = (
            "completed",
            100,
            now,
            now + self.expiry_s,
        )
        self.store.save(job)

    def _fail(self, job: VideoJob, message: str) -> None:
        job.status, job.error = "failed", {"code": "video_failed", "message": message}
        self.store.save(job)


__all__ = ["VARIANTS", "VideoRunner", "new_job_id", "to_request"]
