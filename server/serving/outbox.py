"""The webhooks' durable outbox: events (a video finished, a batch ended) written where the jobs
live, in the store `--job-store` names, so an event outlives a restart and any replica sharing
a Redis store may deliver it.

A producer adds an event before it stores the move the event announces (`Outbox.add`: one write,
idempotent by the event's id, which a move always gives the same); the deliverer
(`serving/webhooks.py`) takes due events one at a time under a lease, and either ends one
(delivered, expired, unconfirmed) or puts it back for later with the endpoints that acknowledged
it. An ended event is kept a week, so a producer adding it again (a job run again after a crash)
adds nothing.

- SQLite: a table `webhook_events` in the job store's file (one row an event; a model's rows only).
- Redis: under `diffshard:<model>:webhooks:`: `event:<id>` (a hash: the event, its tries, the
  endpoints that acknowledged it, who holds it), `due` (pending ids by when next due, in ms: a
  take moves one past its lease, so a holder that dies lets it come due again) and `pending`
  (pending ids by created_at, for the lag). Each move is one Lua script.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from dataclasses import dataclass
from typing import Protocol

from server.errors import StoreUnavailable
from server.serving.sqlitestore import open_file

ENDINGS = ("delivered", "expired", "unconfirmed")  # how an event leaves the outbox
KEEP_ENDED_S = 7 * 86400  # an ended event is kept this long: adding it again adds nothing


@dataclass(frozen=True)
class Event:
    id: str  # "evt_" + a stable hash of (type, subject): the same transition always makes the same event
    type: str  # "video.completed", "video.failed", "batch.completed", ...
    subject: str  # data.id: the video job's or batch's id
    created_at: int  # unix seconds

    def body(self) -> bytes:
        """OpenAI's event object, as the webhook's body."""
        shape = {
            "id": self.id,
            "object": "event",
            "created_at": self.created_at,
            "type": self.type,
            "data": {"id": self.subject},
        }
        return json.dumps(shape, separators=(",", ":")).encode()


def event_for(type: str, subject: str, created_at: int) -> Event:
    digest = hashlib.sha256(f"{type}\0{subject}".encode()).hexdigest()[:32]
    return Event(f"evt_{digest}", type, subject, created_at)


@dataclass(frozen=True)
class Pending:
    """An event taken for delivery: how often it was tried, which endpoints acknowledged it."""

    event: Event
    tries: int
    acked: frozenset[str]


class Outbox(Protocol):
    def add(self, event: Event) -> None:
        """Idempotent by id; durable once it returns (as the store is); one write."""
        ...

    def take(self, holder: str, now: float, lease_s: float) -> Pending | None:
        """The pending event due first (due by `now`), held by `holder` for `lease_s`."""
        ...

    def later(self, event_id: str, holder: str, due: float, tries: int, acked: frozenset[str]) -> bool:
        """Due again at `due` (unix seconds), if `holder` still holds it."""
        ...

    def end(self, event_id: str, holder: str, ending: str, now: float) -> bool:
        """Out of the outbox as `ending` (one of ENDINGS), if `holder` still holds it."""
        ...

    def backlog(self) -> tuple[int, int | None]:
        """Pending events, and the oldest one's created_at (None: none pending)."""
        ...

    def purge(self, before: float) -> int: ...
    def close(self) -> None: ...


def open_outbox(job_store_url: str, model: str) -> Outbox:
    """The outbox beside `model`'s jobs in the store `job_store_url` names (ConfigError when it
    cannot be opened or reached)."""
    if job_store_url.startswith(("redis://", "rediss://")):
        return RedisOutbox(job_store_url, model)
    return SqliteOutbox(job_store_url, model)


SCHEMA = (
    "CREATE TABLE IF NOT EXISTS webhook_events (model TEXT, id TEXT, type TEXT, subject TEXT, "
    "created_at INTEGER, ended TEXT, ended_at REAL, due_at REAL, holder TEXT, tries INTEGER, "
    "acked TEXT, PRIMARY KEY (model, id))",
    "CREATE INDEX IF NOT EXISTS webhook_events_due ON webhook_events (model, ended, due_at)",
)


class SqliteOutbox:
    """A table in the job store's SQLite file (one connection under a lock, as the store's)."""

    def __init__(self, url: str, model: str) -> None:
        self.model = model
        self.path, self._db = open_file(url, SCHEMA)
        self._lock = threading.Lock()

    def _run(self, query: str, args: tuple) -> sqlite3.Cursor:
        try:
            with self._lock:
                return self._db.execute(query, args)
        except sqlite3.OperationalError as err:  # locked past the timeout, the disk gone: try later
            raise StoreUnavailable() from err

    def add(self, event: Event) -> None:
        self._run(
            "INSERT OR IGNORE INTO webhook_events VALUES (?, ?, ?, ?, ?, NULL, NULL, ?, NULL, 0, '[]')",
            (self.model, event.id, event.type, event.subject, event.created_at, event.created_at),
        )

    def take(self, holder: str, now: float, lease_s: float) -> Pending | None:
        row = self._run(
            "UPDATE webhook_events SET due_at = ?, holder = ? WHERE model = ? AND id = (SELECT id FROM "
            "webhook_events WHERE model = ? AND ended IS NULL AND due_at <= ? ORDER BY due_at LIMIT 1) "
            "RETURNING id, type, subject, created_at, tries, acked",
            (now + lease_s, holder, self.model, self.model, now),
        ).fetchone()
        if row is None:
            return None
        return Pending(Event(*row[:4]), row[4], frozenset(json.loads(row[5])))

    def later(self, event_id: str, holder: str, due: float, tries: int, acked: frozenset[str]) -> bool:
        return bool(
            self._run(
                "UPDATE webhook_events SET due_at = ?, tries = ?, acked = ?, holder = NULL "
                "WHERE model = ? AND id = ? AND holder = ? AND ended IS NULL",
                (due, tries, json.dumps(sorted(acked)), self.model, event_id, holder),
            ).rowcount
        )

    def end(self, event_id: str, holder: str, ending: str, now: float) -> bool:
        return bool(
            self._run(
                "UPDATE webhook_events SET ended = ?, ended_at = ?, holder = NULL "
                "WHERE model = ? AND id = ? AND holder = ? AND ended IS NULL",
                (ending, now, self.model, event_id, holder),
            ).rowcount
        )

    def backlog(self) -> tuple[int, int | None]:
        count, oldest = self._run(
            "SELECT COUNT(*), MIN(created_at) FROM webhook_events WHERE model = ? AND ended IS NULL",
            (self.model,),
        ).fetchone()
        return int(count), oldest

    def purge(self, before: float) -> int:
        return self._run(
            "DELETE FROM webhook_events WHERE model = ? AND ended IS NOT NULL AND ended_at < ?",
            (self.model, before),
        ).rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()


# ARGV: prefix, id, type, subject, created_at. Added unless it is there (pending or ended).
ADD = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'event:' .. id
if redis.call('EXISTS', key) == 1 then return 0 end
redis.call('HSET', key, 'type', ARGV[3], 'subject', ARGV[4], 'created_at', ARGV[5], 'tries', 0, 'acked', '[]')
redis.call('ZADD', p .. 'due', tonumber(ARGV[5]) * 1000, id)
redis.call('ZADD', p .. 'pending', ARGV[5], id)
return 1
"""

# ARGV: prefix, holder, now ms, lease ms. The event due first, moved past its lease and held.
TAKE = """
local p = ARGV[1]
local due = redis.call('ZRANGEBYSCORE', p .. 'due', '-inf', ARGV[3], 'LIMIT', 0, 1)
if #due == 0 then return false end
local id = due[1]
redis.call('ZADD', p .. 'due', tonumber(ARGV[3]) + tonumber(ARGV[4]), id)
redis.call('HSET', p .. 'event:' .. id, 'holder', ARGV[2])
return id
"""

# ARGV: prefix, id, holder, due ms, tries, acked (JSON). Due again, if `holder` holds it.
LATER = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'event:' .. id
if redis.call('HGET', key, 'holder') ~= ARGV[3] then return 0 end
redis.call('HSET', key, 'tries', ARGV[5], 'acked', ARGV[6], 'holder', '')
redis.call('ZADD', p .. 'due', ARGV[4], id)
return 1
"""

# ARGV: prefix, id, holder, ending, kept s. Ended, if `holder` holds it; kept a while (for add).
END = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'event:' .. id
if redis.call('HGET', key, 'holder') ~= ARGV[3] then return 0 end
redis.call('ZREM', p .. 'due', id)
redis.call('ZREM', p .. 'pending', id)
redis.call('HSET', key, 'ended', ARGV[4], 'holder', '')
redis.call('EXPIRE', key, ARGV[5])
return 1
"""


class RedisOutbox:
    """Keys under `diffshard:<model>:webhooks:` in the job store's Redis (its own connection)."""

    def __init__(self, url: str, model: str) -> None:
        import redis  # the client only where Redis is used

        from server.serving.redisstore import connect

        self.prefix = f"diffshard:{model}:webhooks:"
        self._errors = redis.RedisError
        # as the job store's (each script here may run twice: add is idempotent, a move checks its holder)
        self._redis = connect(url)
        self._scripts = {
            name: self._redis.register_script(text)
            for name, text in [("add", ADD), ("take", TAKE), ("later", LATER), ("end", END)]
        }

    def _script(self, name: str, *args: object) -> object:
        try:
            return self._scripts[name](args=[self.prefix, *args])
        except self._errors as err:
            raise StoreUnavailable() from err

    def add(self, event: Event) -> None:
        self._script("add", event.id, event.type, event.subject, event.created_at)

    def take(self, holder: str, now: float, lease_s: float) -> Pending | None:
        taken = self._script("take", holder, int(now * 1000), int(lease_s * 1000))
        if taken is None:
            return None
        event_id = taken.decode()  # type: ignore[union-attr]
        try:
            raw = self._redis.hgetall(f"{self.prefix}event:{event_id}")
        except self._errors as err:
            raise StoreUnavailable() from err
        fields = {k.decode(): v.decode() for k, v in raw.items()}  # type: ignore[union-attr]
        event = Event(event_id, fields["type"], fields["subject"], int(fields["created_at"]))
        return Pending(event, int(fields["tries"]), frozenset(json.loads(fields["acked"])))

    def later(self, event_id: str, holder: str, due: float, tries: int, acked: frozenset[str]) -> bool:
        acked_json = json.dumps(sorted(acked))
        return bool(self._script("later", event_id, holder, int(due * 1000), tries, acked_json))

    def end(self, event_id: str, holder: str, ending: str, now: float) -> bool:
        return bool(self._script("end", event_id, holder, ending, KEEP_ENDED_S))

    def backlog(self) -> tuple[int, int | None]:
        try:
            with self._redis.pipeline(transaction=False) as batch:
                batch.zcard(f"{self.prefix}pending").zrange(f"{self.prefix}pending", 0, 0, withscores=True)
                count, oldest = batch.execute()
        except self._errors as err:
            raise StoreUnavailable() from err
        return int(count), int(oldest[0][1]) if oldest else None

    def purge(self, before: float) -> int:
        return 0  # ended events expire by themselves (END sets their expiry)

    def close(self) -> None:
        self._redis.close()
