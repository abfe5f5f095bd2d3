"""OpenAI's Batch API, stored: files (`/v1/files`: a batch's JSONL input, its output and errors),
batches, and each batch's lines with their results, in the job store the server opens for
videos (`--job-store`): SQLite (`batchsqlite.py`) or a Redis that replicas share (`batchredis.py`).

A batch's lines are not video jobs in the job store's queue, though that queue has leases and
fairness already: a batch brings thousands of lines at once, and the video queue's claim scans
its whole queue (bounded by --max-queue), adds a job a transaction, and has no way to drop the
queued lines of a cancelled or expired batch. Here a batch is added with all its lines in one
step, a claim takes the next line of the batch whose owner's turn is oldest (fair between keys,
however long one key's batch is), and cancel or expiry drops its queued lines in one step.

Each line runs exactly once into the output: a claim holds it under a lease its runner renews; a
result is kept only while its runner still holds it (`finish`), and a line whose runner died is
queued again once its lease lapses (`recover`). A batch is closed (its output and error files
written, its final status set) by one runner: `take_close` is a compare-and-set on a lease of
its own, so a closer that dies leaves it to another.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from server.serving.videostore import Content

# What a batch's status can be, as OpenAI's Batch object says it. "validating" is never stored:
# a batch's input is checked when it is created.
UNFINISHED = ("in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")
OUTPUT, ERRORS = "batch_output", "batch_error"  # the purposes of the files a batch writes


def new_id(kind: str) -> str:
    """`file-…`, `batch_…`, `batch_req_…`: OpenAI's spelling of each kind's ids."""
    return f"{kind}{secrets.token_hex(12)}"


@dataclass
class StoredFile:
    """One `/v1/files` file: what OpenAI's File object shows, and its owner."""

    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": self.expires_at,
            "status_details": None,
        }

    @staticmethod
    def decode(text: str | bytes) -> StoredFile:
        values = json.loads(text)
        return StoredFile(**{k: v for k, v in values.items() if k in FILE_FIELDS})


FILE_FIELDS = {f.name for f in fields(StoredFile)}


@dataclass
class Batch:
    """One batch: what OpenAI's Batch object shows, its owner and model, and how it is stopped
    (`stopped`: "cancel" or "expire", its queued lines dropped)."""

    id: str
    owner: str
    model: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "in_progress"
    total: int = 0
    completed: int = 0
    failed: int = 0
    metadata: dict[str, str] | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    stopped: str | None = None
    output_expires_s: int | None = None  # its output and error files' keeping (output_expires_after)

    def public(self) -> dict[str, Any]:
        """The batch as OpenAI's Batch object."""
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": None if self.errors is None else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }

    @property
    def finished(self) -> bool:
        return self.status in ENDED

    @property
    def ended_at(self) -> int | None:
        """When it reached its final status (None: it has not)."""
        ends = (self.completed_at, self.failed_at, self.expired_at, self.cancelled_at)
        return next((t for t in ends if t is not None), None) if self.finished else None

    @staticmethod
    def decode(values: dict[str, Any]) -> Batch:
        return Batch(**{k: v for k, v in values.items() if k in BATCH_FIELDS})

    def encoded(self) -> str:
        return json.dumps(asdict(self))


BATCH_FIELDS = {f.name for f in fields(Batch)}


@dataclass(frozen=True)
class LineInput:
    """One line of a batch's input file, as checked at upload: its body kept as sent (JSON text)."""

    custom_id: str
    url: str
    body: str
    id: str = field(default_factory=lambda: new_id("batch_req_"))

    def encoded(self) -> str:
        return json.dumps({"id": self.id, "custom_id": self.custom_id, "url": self.url, "body": self.body})

    @staticmethod
    def decode(text: str | bytes) -> LineInput:
        return LineInput(**json.loads(text))


@dataclass(frozen=True)
class Line:
    """A claimed line: which batch and line, what it asks, and for whom until when."""

    batch: str
    index: int
    input: LineInput
    owner: str
    expires_at: int  # the batch's window ends: the line's deadline

    @property
    def key(self) -> tuple[str, int]:
        return self.batch, self.index


@dataclass(frozen=True)
class Result:
    """A line as the batch's output or error file holds it (None: it never ran)."""

    index: int
    input: LineInput
    text: bytes | None
    failed: bool


class BatchStore(Protocol):
    """Where files, batches and their lines live. `worker` names the runner holding a line (one
    per process); only its holder may end a running line."""

    def add_file(self, file: StoredFile, content: bytes, max_bytes: int) -> bool:
        """Keep `file` with its content unless the files kept would pass `max_bytes`: False then."""
        ...

    def get_file(self, file_id: str) -> StoredFile | None: ...
    def file_content(self, file_id: str) -> Path | Content | None: ...
    def page_files(
        self, owner: str | None, after: str | None, limit: int, order: str, purpose: str | None
    ) -> tuple[list[StoredFile], bool]: ...
    def delete_file(self, file_id: str) -> bool: ...

    def add_batch(self, batch: Batch, lines: list[LineInput], per_owner: int | None) -> bool:
        """Add `batch` and its lines, queued, unless its owner has `per_owner` unfinished already
        (counted and added in one step): False then."""
        ...

    def get_batch(self, batch_id: str) -> Batch | None: ...
    def page_batches(
        self, owner: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[Batch], bool]: ...
    def unfinished(self) -> list[Batch]:
        """This model's batches in progress, finalizing or cancelling (the runner's rounds)."""
        ...

    def claim(self, worker: str, now: float, lease_s: float) -> Line | None:
        """The next queued line, held by `worker`: of the batch whose owner's last turn is oldest."""
        ...

    def renew(self, worker: str, keys: Iterable[tuple[str, int]], now: float, lease_s: float) -> set:
        """Leases of the lines `worker` holds renewed; the keys of those it should stop running
        (another runner holds them, or their batch was cancelled or expired)."""
        ...

    def finish(self, worker: str, key: tuple[str, int], text: bytes, failed: bool) -> bool:
        """The line's result kept (the output's or, `failed`, the errors'), if `worker` holds it."""
        ...

    def release(self, worker: str, key: tuple[str, int]) -> bool:
        """A line `worker` holds, given up without a result: queued again (its batch not stopped)."""
        ...

    def recover(self, now: float) -> int:
        """Running lines whose lease lapsed (their runner died), queued again; how many."""
        ...

    def stop(self, batch_id: str, why: str, now: int) -> Batch | None:
        """Cancel ("cancel": cancelling) or expire ("expire") an unfinished batch: its queued lines
        dropped in the same step. The batch as it is after; None if there is none."""
        ...

    def take_close(self, batch_id: str, worker: str, now: float, lease_s: float) -> Batch | None:
        """The batch, held by `worker` to be closed, if no line of it is queued or running and no
        other runner is closing it (an in-progress one is now finalizing); else None."""
        ...

    def results(self, batch_id: str) -> Iterator[Result]:
        """Every line of the batch, in the input's order, with its result if it has one."""
        ...

    def close(self, batch: Batch, worker: str, files: list[tuple[StoredFile, Iterable[bytes]]]) -> bool:
        """The batch's final fields and its files written, if `worker` is closing it; its lines gone."""
        ...

    def tidy(self, now: int, max_bytes: int, keep_s: int) -> int:
        """Expired files, and batches ended `keep_s` ago, gone; then the first files to expire
        while those kept pass `max_bytes`; how many went."""
        ...

    def close_store(self) -> None: ...
