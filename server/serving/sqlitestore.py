"""The default job store: one server's video jobs in an embedded SQLite file, their content
(MP4, frames, thumbnail, spritesheet) in a folder per job beside it, under the data directory.

One server runs a model's jobs in a file (a lock file says which; a second one is refused at
start): the jobs a crash left `in_progress` are queued again when the next one starts (`recover`'s
first call). Servers of other models may share the file, each seeing only its own jobs. Several
replicas share a Redis store instead.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import IO

from server.errors import ConfigError, StoreRefused
from server.serving.videostore import CANCELLED, VideoJob, parse_job_store

UNFINISHED = "status IN ('queued', 'in_progress')"
MINE = "json_extract(job, '$.model') = ?"  # this store's model's jobs (others' may share the file)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, owner TEXT, status TEXT, created_at INTEGER, "
    "job TEXT)",
    # each owner's last turn at a claim (one row an API key): claims go round the owners
    "CREATE TABLE IF NOT EXISTS turns (model TEXT, owner TEXT, turn INTEGER, PRIMARY KEY (model, owner))",
)


def open_file(url: str, schema: Iterable[str]) -> tuple[Path, sqlite3.Connection]:
    """The job store's SQLite file (`sqlite:///PATH`), made if missing, in WAL mode (readers beside a
    writer), with `schema`'s statements run; ConfigError naming the setting when it cannot be opened.
    The job store, the batch store and the webhooks' outbox each open it so: tables of their own."""
    path = Path(parse_job_store(url).removeprefix("sqlite:///")).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        for statement in schema:
            db.execute(statement)
    except (OSError, sqlite3.Error) as err:
        raise ConfigError(f"--job-store (DIFFSHARD_JOB_STORE): cannot open {path}: {err}") from err
    return path, db


class SqliteJobStore:
    """Jobs in one SQLite file (thread-safe: one connection under a lock), content in folders
    beside it. Leases are not needed with one server a file: `progress`, `release` and `finish`
    hold while the job is `in_progress` (not once it was cancelled)."""

    def __init__(self, url: str, model: str, *, runs: bool = False) -> None:
        self.model = model
        self.path, self._db = open_file(url, SCHEMA)
        self._lock = threading.Lock()
        self._recovered = False
        self.content_folder = self.path.parent / "videos"
        self._runs = self._hold_model_lock() if runs else None  # a reader (a tool, a test) runs nothing

    def _hold_model_lock(self) -> IO[str]:
        """This process runs the model's jobs in this file; ConfigError if another one does (it
        would queue again, and tidy, the jobs this one runs). The OS drops the lock with the process."""
        digest = hashlib.sha256(self.model.encode()).hexdigest()[:12]
        path = self.path.with_name(f"{self.path.name}.{digest}.lock")
        held = path.open("a+")
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held.close()
            raise ConfigError(
                f"--job-store (DIFFSHARD_JOB_STORE): another server runs {self.model}'s video jobs in "
                f"{self.path}; give this one a file of its own (sqlite:///PATH), or share a redis:// store"
            ) from None
        return held

    def folder(self, job_id: str) -> Path:
        return self.content_folder / job_id

    def add(
        self,
        job: VideoJob,
        per_owner: int | None = None,
        total: int | None = None,
        files: dict[str, bytes] | None = None,
    ) -> str | None:
        if files:  # before the job, which a runner may take at once; gone again if it is refused
            self._write(job.id, files)
        refused: str | None = None
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # the file's write lock: counts and insert as one
            try:
                if per_owner is not None and self._unfinished(job.owner) >= per_owner:
                    refused = "owner"
                elif total is not None and self._unfinished(None) >= total:
                    refused = "total"
                else:
                    self._db.execute(
                        "INSERT INTO jobs VALUES (?, ?, ?, ?, ?)",
                        (job.id, job.owner, job.status, job.created_at, json.dumps(asdict(job))),
                    )
            finally:
                self._db.execute("COMMIT")
        if refused and files:
            shutil.rmtree(self.folder(job.id), ignore_errors=True)
        return refused

    def get(self, job_id: str) -> VideoJob | None:
        with self._lock:
            row = self._db.execute("SELECT job FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else VideoJob(**json.loads(row[0]))

    def _save(self, job: VideoJob, running: bool = False) -> bool:
        """`job` written (`running`: only while it is still in progress); whether it was."""
        held = " AND status = 'in_progress'" if running else ""
        with self._lock:
            return bool(
                self._db.execute(
                    f"UPDATE jobs SET status = ?, job = ? WHERE id = ?{held}",
                    (job.status, json.dumps(asdict(job)), job.id),
                ).rowcount
            )

    def page(
        self, owner: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[VideoJob], bool]:
        """`limit` jobs (of `owner`; None: everyone's) after the job `after`, newest first unless
        `order` is "asc"; and whether more follow."""
        sign, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where, args = [MINE], [self.model]
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

    def claim(self, worker: str) -> VideoJob | None:
        """This model's next queued job, now `in_progress`: the oldest of the owner whose last turn
        is longest ago (or who never had one), so one key's queue does not hold up another's."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # choose, take and count the turn as one
            try:
                row = self._db.execute(
                    "UPDATE jobs SET status = 'in_progress', "
                    "job = json_set(job, '$.status', 'in_progress', '$.progress', 0, '$.step', 0) "
                    "WHERE id = (SELECT j.id FROM jobs j "
                    "LEFT JOIN turns t ON t.model = ? AND t.owner = j.owner "
                    "WHERE j.status = 'queued' AND json_extract(j.job, '$.model') = ? "
                    "ORDER BY COALESCE(t.turn, 0), j.created_at, j.id LIMIT 1) RETURNING owner, job",
                    (self.model, self.model),
                ).fetchone()
                if row is not None:
                    self._db.execute(
                        "INSERT INTO turns VALUES (?1, ?2, (SELECT COALESCE(MAX(turn), 0) + 1 FROM turns "
                        "WHERE model = ?1)) ON CONFLICT (model, owner) DO UPDATE SET turn = excluded.turn",
                        (self.model, row[0]),
                    )
            finally:
                self._db.execute("COMMIT")
        return None if row is None else VideoJob(**json.loads(row[1]))

    def progress(self, job: VideoJob, worker: str) -> bool:
        """Its progress fields only (a renewal on another thread never writes a status), while it runs."""
        with self._lock:
            return bool(
                self._db.execute(
                    "UPDATE jobs SET job = json_set(job, '$.progress', ?, '$.step', ?, '$.steps', ?) "
                    "WHERE id = ? AND status = 'in_progress'",
                    (job.progress, job.step, job.steps, job.id),
                ).rowcount
            )

    def release(self, job: VideoJob, worker: str) -> bool:
        job.status, job.progress, job.step = "queued", 0, 0
        return self._save(job, running=True)

    def finish(self, job: VideoJob, worker: str, content: dict[str, bytes] | None) -> bool:
        if content:
            try:
                self._write(job.id, content)
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                raise StoreRefused(
                    f"the video's content ({job.bytes / 2**20:.1f} MiB) does not fit on the job store's "
                    "disk: ask for fewer frames or a smaller size, or ask the operator for room"
                ) from err
        if self._save(job, running=True):
            return True
        for name in content or ():  # cancelled meanwhile: nobody downloads it
            (self.folder(job.id) / name).unlink(missing_ok=True)
        return False

    def _write(self, job_id: str, files: dict[str, bytes]) -> None:
        """`files` into the job's folder, each written beside it and then moved in: a download
        never meets half a file."""
        folder = self.folder(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            written = folder / f".{name}.writing"
            try:
                written.write_bytes(data)
                written.replace(folder / name)
            finally:
                written.unlink(missing_ok=True)

    def recover(self) -> int:
        """At the first call (this server's start): the jobs a stopped process left
        `in_progress`, queued again; how many. Later calls find none: this server runs the file."""
        if self._recovered:
            return 0
        self._recovered = True
        with self._lock:
            rows = self._db.execute(
                f"SELECT job FROM jobs WHERE status = 'in_progress' AND {MINE}", (self.model,)
            ).fetchall()
        for (raw,) in rows:
            job = VideoJob(**json.loads(raw))
            job.status, job.progress, job.step = "queued", 0, 0
            self._save(job)
        return len(rows)

    def cancel(self, job_id: str, expires_at: int) -> VideoJob | None:
        with self._lock:
            row = self._db.execute(
                "UPDATE jobs SET status = 'failed', job = json_set(job, '$.status', 'failed', "
                "'$.error', json(?), '$.expires_at', ?) "
                f"WHERE id = ? AND {UNFINISHED} RETURNING job",
                (json.dumps(CANCELLED), expires_at, job_id),
            ).fetchone()
        return VideoJob(**json.loads(row[0])) if row is not None else self.get(job_id)

    def on_cancel(self, stop: Callable[[str], None]) -> None:
        """One server a file: every cancel is its own, stopped where it is made."""

    def delete(self, job_id: str) -> bool:
        with self._lock:
            gone = self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount
        shutil.rmtree(self.folder(job_id), ignore_errors=True)
        return bool(gone)

    def content(self, job_id: str, name: str) -> Path | None:
        path = self.folder(job_id) / name
        return path if path.is_file() else None

    def unfinished(self, owner: str | None = None) -> int:
        """This model's jobs queued or in progress (of `owner`; None: everyone's)."""
        with self._lock:
            return self._unfinished(owner)

    def _unfinished(self, owner: str | None) -> int:
        query, args = f"SELECT COUNT(*) FROM jobs WHERE {UNFINISHED} AND {MINE}", [self.model]
        if owner is not None:
            query, args = query + " AND owner = ?", [*args, owner]
        return int(self._db.execute(query, args).fetchone()[0])

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT status, COUNT(*) FROM jobs WHERE {MINE} GROUP BY status", (self.model,)
            ).fetchall()
        return dict(rows)

    def finished(self) -> list[VideoJob]:
        """This model's completed and failed jobs, the first to go first: those expiring first,
        then the oldest."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT job FROM jobs WHERE status IN ('completed', 'failed') AND {MINE}", (self.model,)
            ).fetchall()
        jobs = [VideoJob(**json.loads(r[0])) for r in rows]
        return sorted(jobs, key=lambda job: (job.expires_at or 0, job.created_at))

    def tidy(self, now: int, max_bytes: int) -> int:
        """Delete jobs past their `expires_at`, then the first to expire while the content
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
        if self._runs is not None:
            self._runs.close()
