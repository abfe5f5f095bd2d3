"""Video jobs that outlive the process: OpenAI's Videos API is asynchronous (a job id, polled
until `completed`), so a job must survive a restart and be answerable by any replica.

`JobStore` is the one small interface the runner and the API use; `--job-store` picks one
(`serving.videos.open_job_store`):
- `sqlite:///PATH` (the default, under the data directory `$XDG_DATA_HOME/diffshard`, a volume
  in compose and Kubernetes): one server's jobs in an embedded file, content in folders beside it
  (`sqlitestore.py`);
- `redis://host:port/db`: jobs and content in one Redis that several replicas share: any replica
  answers any job, jobs are taken from one queue exactly once, and a job whose replica died is
  taken again once its lease lapses (`redisstore.py`).

A running job is held under a lease its runner renews; a runner that stops gracefully gives its
job back (`release`), and a job a crash left `in_progress` runs again: at the next start
(SQLite) or once its lease lapses (Redis). Nothing has to be resubmitted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit

STATUSES = ("queued", "in_progress", "completed", "failed")
# What a cancelled job's `error` says (OpenAI's Video has no cancelled status: it ends failed).
CANCELLED = {"code": "cancelled", "message": "the video was cancelled before it finished"}
PIECE = 1 << 18  # content is written to and read from a store in pieces of this many bytes (256 KiB)


@dataclass(frozen=True)
class Content:
    """A stored file read a piece at a time (`read(offset, length)`), so a download of a large
    frames ZIP never holds it whole: a Redis value, read with GETRANGE."""

    size: int
    read: Callable[[int, int], bytes]

    def pieces(self) -> Iterator[bytes]:
        for offset in range(0, self.size, PIECE):
            piece = self.read(offset, PIECE)
            if not piece:  # deleted while being read
                return
            yield piece


def read_whole(content: Path | Content | None) -> bytes | None:
    """A small stored file's bytes (a reference image), wherever the store keeps it."""
    if content is None or isinstance(content, Path):
        return None if content is None else content.read_bytes()
    return b"".join(content.pieces())


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
    step: int = 0  # denoising steps done of `steps` (the progress events'), while it runs
    steps: int = 0

    def public(self) -> dict[str, Any]:
        """The job as OpenAI's `Video` object."""
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "error": self.error,
            "prompt": self.prompt,
            "size": self.size,
            "seconds": self.seconds,
            "remixed_from_video_id": None,
        }

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")


class JobStore(Protocol):
    """Where jobs and their content live. `worker` names the runner holding a job (one per
    process); only its holder may move a running job on."""

    def add(
        self,
        job: VideoJob,
        per_owner: int | None = None,
        total: int | None = None,
        files: dict[str, bytes] | None = None,
    ) -> str | None:
        """Queue `job`, with `files` beside it (its reference image), unless its owner already
        has `per_owner` jobs unfinished ("owner") or the store `total` ("total"): counted and
        added in one step, so concurrent adds never pass a bound together. None once added."""
        ...

    def get(self, job_id: str) -> VideoJob | None: ...
    def page(
        self, owner: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[VideoJob], bool]: ...
    def claim(self, worker: str) -> VideoJob | None: ...
    def progress(self, job: VideoJob, worker: str) -> bool:
        """`job`'s progress fields written and its lease renewed, while `worker` holds it."""
        ...

    def release(self, job: VideoJob, worker: str) -> bool: ...
    def finish(self, job: VideoJob, worker: str, content: dict[str, bytes] | None) -> bool:
        """Completed (with `content`) or failed, if `worker` holds it; StoreRefused when the store
        will not keep the content (its size), StoreUnavailable when it does not answer."""
        ...

    def cancel(self, job_id: str, expires_at: int) -> VideoJob | None:
        """A queued or running job ended `failed` with error `CANCELLED`, in one step: taken out
        of the queue, or from its runner (whose next renewal finds it no longer held, and whose
        `finish` is refused), never run by any replica after. The job as it is now (a finished
        one unchanged); None if there is none."""
        ...

    def on_cancel(self, stop: Callable[[str], None]) -> None:
        """Call `stop(job_id)` soon after any process sharing the store cancels a job, so that its
        runner stops it at once (a store only this process uses need not: `cancel` runs here)."""
        ...

    def recover(self) -> int: ...
    def delete(self, job_id: str) -> bool: ...
    def content(self, job_id: str, name: str) -> Path | Content | None: ...
    def unfinished(self, owner: str | None = None) -> int: ...
    def counts(self) -> dict[str, int]: ...
    def tidy(self, now: int, max_bytes: int) -> int: ...
    def close(self) -> None: ...


def default_job_store() -> str:
    home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return f"sqlite:///{Path(home) / 'diffshard' / 'jobs.sqlite'}"


def parse_job_store(value: object) -> str:
    """`sqlite:///PATH` (or a bare path) or `redis://[:password@]host[:port][/db]`."""
    text = str(value).strip()
    if text.startswith(("redis://", "rediss://")):
        parts = urlsplit(text)
        path = parts.path.strip("/")
        if not parts.hostname or (path and not path.isdigit()):
            raise ValueError("write redis://HOST[:PORT][/DB] (DB a number), e.g. redis://redis:6379/0")
        return text
    if text.startswith("sqlite:///"):
        text = text.removeprefix("sqlite:///")
    elif "://" in text:
        raise ValueError(f"write sqlite:///PATH or redis://HOST:PORT/DB, got {shown(text)!r}")
    if not text:
        raise ValueError("write sqlite:///PATH to a file, or redis://HOST:PORT/DB")
    return f"sqlite:///{text}"


def shown(url: str) -> str:
    """A store's URL without its password, for messages and logs: the one before the host, and
    one in the query (`redis://host/0?password=...`, which redis-py reads too)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(k.lower() == "password" for k, _ in query):
        return url
    if parts.password is not None:
        parts = parts._replace(netloc=f"***@{parts.netloc.rsplit('@', 1)[1]}")
    query = [(k, "***" if k.lower() == "password" else v) for k, v in query]
    return parts._replace(query=urlencode(query, safe="*")).geturl()
