"""The Batch API's store in the job store's SQLite file: files, batches and their lines in tables
beside the video jobs' (several servers of a model may share the file: each move is one
transaction under the file's write lock, and a line is held under a lease), files' content in a
folder beside it.

    batch_files  a file's record (content: batchfiles/<id>)
    batches      a batch's record; `closer`, `closing_until`: the runner writing its files
    batch_lines  a batch's lines: queued → running (holder, lease_until) → done (result) | dropped
    batch_turns  each owner's last claim: claims go round the owners
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

from server.errors import ConfigError
from server.serving.batchstore import UNFINISHED, Batch, Line, LineInput, Result, StoredFile
from server.serving.sqlitestore import open_file

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS batch_files (id TEXT PRIMARY KEY, model TEXT, owner TEXT, purpose TEXT, "
    "created_at INTEGER, expires_at INTEGER, bytes INTEGER, record TEXT)",
    "CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, model TEXT, owner TEXT, status TEXT, "
    "created_at INTEGER, ended_at INTEGER, closer TEXT, closing_until REAL, record TEXT)",
    "CREATE TABLE IF NOT EXISTS batch_lines (batch TEXT, line INTEGER, state TEXT, holder TEXT, "
    "lease_until REAL, input TEXT, result BLOB, failed INTEGER, PRIMARY KEY (batch, line))",
    "CREATE INDEX IF NOT EXISTS batch_lines_state ON batch_lines (batch, state, line)",
    "CREATE TABLE IF NOT EXISTS batch_turns (model TEXT, owner TEXT, turn INTEGER, "
    "PRIMARY KEY (model, owner))",
)
UNFINISHED_SQL = "status IN ('in_progress', 'finalizing', 'cancelling')"
RESULTS_PAGE = 64  # lines read at once while a batch's files are written
# a line's batch has not been cancelled or expired; a line let go is queued again only then
NOT_STOPPED = (
    "(SELECT json_extract(b.record, '$.stopped') FROM batches b WHERE b.id = batch_lines.batch) IS NULL"
)
AGAIN = f"state = CASE WHEN {NOT_STOPPED} THEN 'queued' ELSE 'dropped' END, holder = NULL"


class SqliteBatchStore:
    def __init__(self, url: str, model: str) -> None:
        self.model = model
        self.path, self._db = open_file(url, SCHEMA)
        self.folder = self.path.parent / "batchfiles"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--job-store (DIFFSHARD_JOB_STORE): cannot make {self.folder}: {err}") from err
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _moving(self) -> Iterator[sqlite3.Connection]:
        """One move: under this process's lock and the file's write lock, committed or rolled back."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, query: str, *args: object) -> list[tuple]:
        with self._lock:
            return self._db.execute(query, args).fetchall()

    # Files.

    def _file_path(self, file_id: str) -> Path:
        return self.folder / file_id

    def _write(self, file: StoredFile, pieces: Iterable[bytes]) -> Path:
        """The content beside its final name (moved in by the move that records it), counted."""
        written, file.bytes = self.folder / f".{file.id}.writing", 0
        with written.open("wb") as out:
            for piece in pieces:
                file.bytes += out.write(piece)
        return written

    def _record_file(self, db: sqlite3.Connection, file: StoredFile, written: Path) -> None:
        written.replace(self._file_path(file.id))
        db.execute(
            "INSERT INTO batch_files VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                file.id,
                self.model,
                file.owner,
                file.purpose,
                file.created_at,
                file.expires_at,
                file.bytes,
                json.dumps(asdict(file)),
            ),
        )

    def add_file(self, file: StoredFile, content: bytes, max_bytes: int) -> bool:
        written = self._write(file, [content])
        try:
            with self._moving() as db:
                held = db.execute(
                    "SELECT COALESCE(SUM(bytes), 0) FROM batch_files WHERE model = ?", (self.model,)
                ).fetchone()[0]
                if held + file.bytes > max_bytes:
                    return False
                self._record_file(db, file, written)
                return True
        finally:
            written.unlink(missing_ok=True)

    def get_file(self, file_id: str) -> StoredFile | None:
        rows = self._read("SELECT record FROM batch_files WHERE id = ? AND model = ?", file_id, self.model)
        return StoredFile.decode(rows[0][0]) if rows else None

    def file_content(self, file_id: str) -> Path | None:
        path = self._file_path(file_id)
        return path if self.get_file(file_id) is not None and path.is_file() else None

    def page_files(
        self, owner: str | None, after: str | None, limit: int, order: str, purpose: str | None
    ) -> tuple[list[StoredFile], bool]:
        where, args = ["model = ?"], [self.model]
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        rows = self._page("batch_files", where, args, after, limit, order)
        files = [StoredFile.decode(r[0]) for r in rows]
        return files[:limit], len(files) > limit

    def _page(
        self, table: str, where: list[str], args: list, after: str | None, limit: int, order: str
    ) -> list[tuple]:
        sign, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        if after is not None:
            anchor = self._read(f"SELECT created_at FROM {table} WHERE id = ?", after)
            if anchor:
                where.append(f"(created_at, id) {sign} (?, ?)")
                args += [anchor[0][0], after]
        query = (
            f"SELECT record FROM {table} WHERE {' AND '.join(where)} "
            f"ORDER BY created_at {direction}, id {direction} LIMIT ?"
        )
        return self._read(query, *args, limit + 1)

    def delete_file(self, file_id: str) -> bool:
        with self._moving() as db:
            gone = db.execute(
                "DELETE FROM batch_files WHERE id = ? AND model = ?", (file_id, self.model)
            ).rowcount
        if gone:
            self._file_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # Batches.

    def _save(self, db: sqlite3.Connection, batch: Batch, **columns: object) -> None:
        sets = ", ".join(f"{name} = ?" for name in ["status", "record", *columns])
        db.execute(
            f"UPDATE batches SET {sets} WHERE id = ?",
            (batch.status, batch.encoded(), *columns.values(), batch.id),
        )

    def _batch(self, db: sqlite3.Connection, batch_id: str) -> Batch | None:
        row = db.execute(
            "SELECT record FROM batches WHERE id = ? AND model = ?", (batch_id, self.model)
        ).fetchone()
        return None if row is None else Batch.decode(json.loads(row[0]))

    def add_batch(self, batch: Batch, lines: list[LineInput], per_owner: int | None) -> bool:
        with self._moving() as db:
            if per_owner is not None and batch.status in UNFINISHED:
                mine = db.execute(
                    f"SELECT COUNT(*) FROM batches WHERE model = ? AND owner = ? AND {UNFINISHED_SQL}",
                    (self.model, batch.owner),
                ).fetchone()[0]
                if mine >= per_owner:
                    return False
            ended = None if batch.status in UNFINISHED else batch.created_at
            db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, ?)",
                (batch.id, self.model, batch.owner, batch.status, batch.created_at, ended, batch.encoded()),
            )
            db.executemany(
                "INSERT INTO batch_lines VALUES (?, ?, 'queued', NULL, NULL, ?, NULL, 0)",
                ((batch.id, index, line.encoded()) for index, line in enumerate(lines)),
            )
        return True

    def get_batch(self, batch_id: str) -> Batch | None:
        with self._lock:
            return self._batch(self._db, batch_id)

    def page_batches(
        self, owner: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[Batch], bool]:
        where, args = ["model = ?"], [self.model]
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        rows = self._page("batches", where, args, after, limit, order)
        batches = [Batch.decode(json.loads(r[0])) for r in rows]
        return batches[:limit], len(batches) > limit

    def unfinished(self) -> list[Batch]:
        rows = self._read(
            f"SELECT record FROM batches WHERE model = ? AND {UNFINISHED_SQL} ORDER BY created_at", self.model
        )
        return [Batch.decode(json.loads(r[0])) for r in rows]

    # Lines.

    def claim(self, worker: str, now: float, lease_s: float) -> Line | None:
        with self._moving() as db:
            chosen = db.execute(
                "SELECT b.id, b.owner, b.record FROM batches b "
                "LEFT JOIN batch_turns t ON t.model = b.model AND t.owner = b.owner "
                "WHERE b.model = ? AND b.status = 'in_progress' AND EXISTS "
                "(SELECT 1 FROM batch_lines l WHERE l.batch = b.id AND l.state = 'queued') "
                "ORDER BY COALESCE(t.turn, 0), b.created_at, b.id LIMIT 1",
                (self.model,),
            ).fetchone()
            if chosen is None:
                return None
            batch_id, owner, record = chosen
            line, text = db.execute(
                "UPDATE batch_lines SET state = 'running', holder = ?, lease_until = ? WHERE batch = ? AND "
                "line = (SELECT MIN(line) FROM batch_lines WHERE batch = ? AND state = 'queued') "
                "RETURNING line, input",
                (worker, now + lease_s, batch_id, batch_id),
            ).fetchone()
            db.execute(
                "INSERT INTO batch_turns VALUES (?1, ?2, (SELECT COALESCE(MAX(turn), 0) + 1 FROM batch_turns "
                "WHERE model = ?1)) ON CONFLICT (model, owner) DO UPDATE SET turn = excluded.turn",
                (self.model, owner),
            )
        expires_at = json.loads(record)["expires_at"]
        return Line(batch_id, line, LineInput.decode(text), owner, expires_at)

    def renew(self, worker: str, keys: Iterable[tuple[str, int]], now: float, lease_s: float) -> set:
        lost = set()
        with self._moving() as db:
            for batch_id, line in keys:
                held = db.execute(
                    f"UPDATE batch_lines SET lease_until = ? WHERE batch = ? AND line = ? AND "
                    f"state = 'running' AND holder = ? AND {NOT_STOPPED}",
                    (now + lease_s, batch_id, line, worker),
                ).rowcount
                if not held:
                    lost.add((batch_id, line))
        return lost

    def finish(self, worker: str, key: tuple[str, int], text: bytes, failed: bool) -> bool:
        batch_id, line = key
        with self._moving() as db:
            held = db.execute(
                "UPDATE batch_lines SET state = 'done', holder = NULL, result = ?, failed = ? "
                "WHERE batch = ? AND line = ? AND state = 'running' AND holder = ?",
                (text, int(failed), batch_id, line, worker),
            ).rowcount
            if held and (batch := self._batch(db, batch_id)) is not None:
                self._save(
                    db,
                    replace(batch, failed=batch.failed + 1)
                    if failed
                    else replace(batch, completed=batch.completed + 1),
                )
        return bool(held)

    def release(self, worker: str, key: tuple[str, int]) -> bool:
        batch_id, line = key
        with self._moving() as db:
            return bool(
                db.execute(
                    f"UPDATE batch_lines SET {AGAIN} "
                    "WHERE batch = ? AND line = ? AND state = 'running' AND holder = ?",
                    (batch_id, line, worker),
                ).rowcount
            )

    def recover(self, now: float) -> int:
        with self._moving() as db:
            return db.execute(
                f"UPDATE batch_lines SET {AGAIN} WHERE state = 'running' AND lease_until < ? AND "
                "batch IN (SELECT id FROM batches WHERE model = ?)",
                (now, self.model),
            ).rowcount

    def stop(self, batch_id: str, why: str, now: int) -> Batch | None:
        with self._moving() as db:
            batch = self._batch(db, batch_id)
            if batch is None or batch.status not in UNFINISHED or batch.stopped is not None:
                return batch
            if why == "cancel" and batch.status == "finalizing":  # every line ran: too late to cancel
                return batch
            batch.stopped = why
            if why == "cancel":
                batch.status, batch.cancelling_at = "cancelling", now
            self._save(db, batch)
            db.execute(
                "UPDATE batch_lines SET state = 'dropped' WHERE batch = ? AND state = 'queued'", (batch_id,)
            )
            return batch

    def take_close(self, batch_id: str, worker: str, now: float, lease_s: float) -> Batch | None:
        with self._moving() as db:
            row = db.execute(
                f"SELECT closer, closing_until FROM batches WHERE id = ? AND model = ? AND {UNFINISHED_SQL}",
                (batch_id, self.model),
            ).fetchone()
            if row is None or (row[0] not in (None, worker) and row[1] >= now):
                return None
            left = db.execute(
                "SELECT COUNT(*) FROM batch_lines WHERE batch = ? AND state IN ('queued', 'running')",
                (batch_id,),
            ).fetchone()[0]
            batch = self._batch(db, batch_id)
            if left or batch is None:
                return None
            if batch.status == "in_progress" and batch.stopped is None:
                batch.status, batch.finalizing_at = "finalizing", int(now)
            self._save(db, batch, closer=worker, closing_until=now + lease_s)
            return batch

    def results(self, batch_id: str) -> Iterator[Result]:
        after = -1
        while True:
            rows = self._read(
                "SELECT line, input, result, failed, state FROM batch_lines WHERE batch = ? AND line > ? "
                "ORDER BY line LIMIT ?",
                batch_id,
                after,
                RESULTS_PAGE,
            )
            for line, text, result, failed, state in rows:
                yield Result(line, LineInput.decode(text), result if state == "done" else None, bool(failed))
            if len(rows) < RESULTS_PAGE:
                return
            after = rows[-1][0]

    def close(self, batch: Batch, worker: str, files: list[tuple[StoredFile, Iterable[bytes]]]) -> bool:
        written = [(file, self._write(file, pieces)) for file, pieces in files]
        try:
            with self._moving() as db:
                row = db.execute(
                    f"SELECT closer FROM batches WHERE id = ? AND {UNFINISHED_SQL}", (batch.id,)
                ).fetchone()
                if row is None or row[0] != worker:
                    return False
                for file, path in written:
                    self._record_file(db, file, path)
                self._save(db, batch, closer=None, ended_at=batch.ended_at)
                db.execute("DELETE FROM batch_lines WHERE batch = ?", (batch.id,))
                return True
        finally:
            for _, path in written:
                path.unlink(missing_ok=True)

    # Housekeeping.

    def tidy(self, now: int, max_bytes: int, keep_s: int) -> int:
        rows = self._read(
            "SELECT id, expires_at, bytes FROM batch_files WHERE model = ? ORDER BY expires_at, created_at",
            self.model,
        )
        held, gone = sum(size for _, _, size in rows), 0
        for file_id, expires_at, size in rows:
            if (expires_at is not None and expires_at <= now) or held > max_bytes:
                held -= size
                gone += self.delete_file(file_id)
        with self._moving() as db:
            ended = db.execute(
                "DELETE FROM batches WHERE model = ? AND ended_at IS NOT NULL AND ended_at <= ? RETURNING id",
                (self.model, now - keep_s),
            ).fetchall()
            for (batch_id,) in ended:
                db.execute("DELETE FROM batch_lines WHERE batch = ?", (batch_id,))
        return gone + len(ended)

    def close_store(self) -> None:
        with self._lock:
            self._db.close()
