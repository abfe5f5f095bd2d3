"""Video jobs that outlive the process: OpenAI's Videos API is asynchronous (a job id, polled
until `completed`), so a job must survive a restart and be answerable after it.

`SqliteJobStore` keeps each job in an embedded SQLite file and its content (the MP4, its frames,
thumbnail and spritesheet) in a folder per job beside it; `--job-store` (`sqlite:///PATH`) names
the file, by default under the data directory (`$XDG_DATA_HOME/diffshard`, a volume in compose
and Kubernetes). A job taken to run is `in_progress`; one a stopped process left so is queued
again at the next start (`requeue`), so nothing is lost and nothing has to be resubmitted.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.errors import ConfigError

STATUSES = ("queued", "in_progress", "completed", "failed")


@dataclass
class VideoJob:
    """One `/v1/videos` job: what OpenAI's `Video` object shows, its owner (an API key's id),
    and the generation it runs (`request`: the GenerationRequest's fields)."""

    id: str
    owner: str
    model: str
    prompt: str
    size: str
    seconds: str
    request: dict[str, Any]
    created_at: int
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, str] | None = None
    bytes: int = 0  # its content's, once completed

    def public(self) -> dict[str, Any]:
        """The job as OpenAI's `Video` object."""
        return {
            "id": self.id, "object": "video", "model": self.model, "status": self.status,
            "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
            "expires_at": self.expires_at, "error": self.error, "prompt": self.prompt, "size": self.size,
            "seconds": self.seconds, "remixed_from_video_id": None,
        }  # fmt: skip


def default_job_store() -> str:
    home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return f"sqlite:///{Path(home) / 'diffshard' / 'jobs.sqlite'}"


def parse_job_store(value: object) -> str:
    """`sqlite:///PATH` (or a bare path); Redis is named for what it will be, not served yet."""
    text = str(value).strip()
    if text.startswith("redis://"):
        raise ValueError("redis:// is not served yet: use sqlite:///PATH (the default: the data directory)")
    if text.startswith("sqlite:///"):
        text = text.removeprefix("sqlite:///")
    elif "://" in text:
        raise ValueError(f"write sqlite:///PATH to a file, got {text!r}")
    if not text:
        raise ValueError("write sqlite:///PATH to a file")
    return f"sqlite:///{text}"


class SqliteJobStore:
    """Jobs in one SQLite file (thread-safe: one connection under a lock), content in folders
    beside it. Several processes may share the file; jobs are taken in one UPDATE, once."""

    def __init__(self, url: str) -> None:
        self.path = Path(parse_job_store(url).removeprefix("sqlite:///")).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, owner TEXT, status TEXT, "
                "created_at INTEGER, job TEXT)"
            )
        except (OSError, sqlite3.Error) as err:
            raise ConfigError(f"--job-store (DIFFSHARD_JOB_STORE): cannot open {self.path}: {err}") from err
        self._lock = threading.Lock()
        self.content = self.path.parent / "videos"

    def folder(self, job_id: str) -> Path:
        return self.content / job_id

    def add(self, job: VideoJob) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, ?, ?)",
                (job.id, job.owner, job.status, job.created_at, json.dumps(asdict(job))),
            )

    def get(self, job_id: str) -> VideoJob | None:
        with self._lock:
            row = self._db.execute("SELECT job FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else VideoJob(**json.loads(row[0]))

    def save(self, job: VideoJob) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = ?, job = ? WHERE id = ?",
                (job.status, json.dumps(asdict(job)), job.id),
            )

    def page(
        self, owner: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[VideoJob], bool]:
        """`limit` jobs (of `owner`; None: everyone's) after the job `after`, newest first unless
        `order` is "asc"; and whether more follow."""
        sign, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where, args = ["1 = 1"], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if after is not None and (anchor := self.get(after)) is not None:
            where.append(f"(created_at, id) {sign} (?, ?)")
            args += [anchor.created_at, anchor.id]
        order_by = f"ORDER BY created_at {direction}, id {direction}"
        query = f"SELECT job FROM jobs WHERE {' AND '.join(where)} {order_by} LIMIT ?"
        with self._lock:
            rows = self._db.execute(query, (*args, limit + 1)).fetchall()
        jobs = [VideoJob(**json.loads(r[0])) for r in rows]
        return jobs[:limit], len(jobs) > limit

    def claim(self) -> VideoJob | None:
        """The oldest queued job, now `in_progress` (taken once, in one statement, whoever else asks)."""
        with self._lock:
            row = self._db.execute(
                "UPDATE jobs SET status = 'in_progress', job = json_set(job, '$.status', 'in_progress') "
                "WHERE id = (SELECT id FROM jobs WHERE status = 'queued' ORDER BY created_at, id LIMIT 1) "
                "RETURNING job"
            ).fetchone()
        return None if row is None else VideoJob(**json.loads(row[0]))

    def requeue(self) -> int:
        """Jobs a stopped process left `in_progress`, queued again (at startup); how many."""
        with self._lock:
            rows = self._db.execute("SELECT job FROM jobs WHERE status = 'in_progress'").fetchall()
        for (raw,) in rows:
            job = VideoJob(**json.loads(raw))
            job.status, job.progress = "queued", 0
            self.save(job)
        return len(rows)

    def delete(self, job_id: str) -> bool:
        with self._lock:
            gone = self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount
        shutil.rmtree(self.folder(job_id), ignore_errors=True)
        return bool(gone)

    def unfinished(self, owner: str | None = None) -> int:
        """Jobs queued or in progress (of `owner`; None: everyone's)."""
        query = "SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'in_progress')"
        args: tuple = ()
        if owner is not None:
            query, args = query + " AND owner = ?", (owner,)
        with self._lock:
            return int(self._db.execute(query, args).fetchone()[0])

    def finished(self) -> list[VideoJob]:
        """Completed and failed jobs, the first to go first: expired ones, then the oldest."""
        with self._lock:
            rows = self._db.execute("SELECT job FROM jobs WHERE status IN ('completed', 'failed')").fetchall()
        jobs = [VideoJob(**json.loads(r[0])) for r in rows]
        return sorted(jobs, key=lambda job: (job.expires_at or 0, job.created_at))

    def tidy(self, now: int, max_bytes: int) -> int:
        """Delete jobs past their `expires_at`, then the oldest finished ones while the content
        holds more than `max_bytes`; how many went."""
        finished, gone = self.finished(), 0
        held = sum(job.bytes for job in finished)
        for job in finished:
            if (job.expires_at is not None and job.expires_at <= now) or held > max_bytes:
                held -= job.bytes
                gone += self.delete(job.id)
        return gone

    def close(self) -> None:
        with self._lock:
            self._db.close()
