"""Video jobs in one Redis that several replicas share (`--job-store redis://host:port/db`):
any replica answers any job's status and content, jobs are taken from one queue exactly once,
and a job whose replica died runs again elsewhere once its lease lapses.

Keys, under `diffshard:<model>:` (models sharing a Redis take only their own jobs):
  job:<id>        hash, the VideoJob's fields each as JSON
  files:<id>      set of its content's file names;  file:<id>:<name>  the file (MP4, frames ZIP,
                  thumbnail, spritesheet), a string written and read in pieces (SETRANGE, GETRANGE),
                  so no command carries a whole frames ZIP; upload:<id>:<worker>:<name> while it
                  is written (expiring: a runner that dies mid-write leaves nothing for long)
  jobs, owner:<o> sorted sets of ids by created_at (listing, paging)
  queue           sorted set of queued ids by created_at
  running         hash, id → the worker holding it;  lease:<id> that worker, expiring
  unfinished, unfinished:<o>, failed   sets;  finished  sorted set by expires_at;  bytes  a count
  turns           hash, owner → its last claim's number from `turn` (a count): claims go round owners
Every move between states is one Lua script, so replicas never see a job half moved. One Redis,
not a cluster: the scripts name keys they derive.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, fields

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from server.errors import ConfigError, StoreRefused, StoreUnavailable
from server.serving.videostore import CANCELLED, PIECE, Content, VideoJob, shown

log = logging.getLogger("diffshard")

FIELDS = [f.name for f in fields(VideoJob)]
RETRIES = 5
UPLOAD_LAPSE_MS = 600_000  # an upload's key lives this long after its last piece unless finished

# KEYS: none. ARGV: prefix, worker, lease ms. The next queued job, held by `worker`: the oldest
# of the owner whose last turn (`turns`: owner → a count from `turn`) is longest ago, or who never
# had one, so one key's queue does not hold up another's. The scan is over the queue, which the
# store's bound (--max-queue) keeps short.
CLAIM = """
local p = ARGV[1]
local id, owner, last
for _, queued in ipairs(redis.call('ZRANGE', p .. 'queue', 0, -1)) do
  local whose = redis.call('HGET', p .. 'job:' .. queued, 'owner')
  local turn = tonumber(redis.call('HGET', p .. 'turns', whose) or '0')
  if id == nil or turn < last then id, owner, last = queued, whose, turn end
end
if not id then return false end
redis.call('ZREM', p .. 'queue', id)
redis.call('HSET', p .. 'turns', owner, redis.call('INCR', p .. 'turn'))
redis.call('HSET', p .. 'running', id, ARGV[2])
redis.call('SET', p .. 'lease:' .. id, ARGV[2], 'PX', ARGV[3])
redis.call('HSET', p .. 'job:' .. id, 'status', '"in_progress"', 'progress', '0', 'step', '0')
return id
"""

# ARGV: prefix, id, owner, created_at, the owner's bound, the store's (-1: none), the number of
# files uploaded with it (the reference image), their names, then field, value pairs. Counted and
# added as one: concurrent creates never pass a bound together.
ADD = """
local p, id, owner, at = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local per_owner, total, files = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local refused = false
if per_owner >= 0 and redis.call('SCARD', p .. 'unfinished:' .. owner) >= per_owner then refused = 'owner'
elseif total >= 0 and redis.call('SCARD', p .. 'unfinished') >= total then refused = 'total' end
for i = 8, 7 + files do
  local upload = p .. 'upload:' .. id .. ':create:' .. ARGV[i]
  if refused then redis.call('DEL', upload) else
    redis.call('RENAME', upload, p .. 'file:' .. id .. ':' .. ARGV[i])
    redis.call('PERSIST', p .. 'file:' .. id .. ':' .. ARGV[i])
    redis.call('SADD', p .. 'files:' .. id, ARGV[i])
  end
end
if refused then return refused end
redis.call('HSET', p .. 'job:' .. id, unpack(ARGV, 8 + files))
redis.call('ZADD', p .. 'jobs', at, id)
redis.call('ZADD', p .. 'owner:' .. owner, at, id)
redis.call('ZADD', p .. 'queue', at, id)
redis.call('SADD', p .. 'unfinished', id)
redis.call('SADD', p .. 'unfinished:' .. owner, id)
return false
"""

# ARGV: prefix, id, worker, lease ms, then field, value pairs to write. Only while `worker`
# holds the job; renews its lease.
PROGRESS = """
local p, id = ARGV[1], ARGV[2]
if redis.call('HGET', p .. 'running', id) ~= ARGV[3] then return 0 end
redis.call('SET', p .. 'lease:' .. id, ARGV[3], 'PX', ARGV[4])
if #ARGV > 4 then redis.call('HSET', p .. 'job:' .. id, unpack(ARGV, 5)) end
return 1
"""

# ARGV: prefix, id, worker, then field, value pairs. Back to the queue, if `worker` holds it.
RELEASE = """
local p, id = ARGV[1], ARGV[2]
if redis.call('HGET', p .. 'running', id) ~= ARGV[3] then return 0 end
redis.call('HDEL', p .. 'running', id)
redis.call('DEL', p .. 'lease:' .. id)
redis.call('HSET', p .. 'job:' .. id, unpack(ARGV, 4))
redis.call('ZADD', p .. 'queue', redis.call('HGET', p .. 'job:' .. id, 'created_at'), id)
return 1
"""

# ARGV: prefix, id, worker, owner key, expires_at, bytes, failed (1/0), then field, value pairs,
# then '--', then the names of the files uploaded. Completed or failed, if `worker` holds it: its
# uploads become its files; else they are dropped.
FINISH = """
local p, id, worker = ARGV[1], ARGV[2], ARGV[3]
local split = 8
while ARGV[split] ~= '--' do split = split + 1 end
if redis.call('HGET', p .. 'running', id) ~= worker then
  for i = split + 1, #ARGV do redis.call('DEL', p .. 'upload:' .. id .. ':' .. worker .. ':' .. ARGV[i]) end
  return 0
end
redis.call('HDEL', p .. 'running', id)
redis.call('DEL', p .. 'lease:' .. id)
redis.call('HSET', p .. 'job:' .. id, unpack(ARGV, 8, split - 1))
for i = split + 1, #ARGV do
  local file = p .. 'file:' .. id .. ':' .. ARGV[i]
  redis.call('RENAME', p .. 'upload:' .. id .. ':' .. worker .. ':' .. ARGV[i], file)
  redis.call('PERSIST', file)
  redis.call('SADD', p .. 'files:' .. id, ARGV[i])
end
redis.call('SREM', p .. 'unfinished', id)
redis.call('SREM', p .. 'unfinished:' .. ARGV[4], id)
redis.call('ZADD', p .. 'finished', ARGV[5], id)
redis.call('INCRBY', p .. 'bytes', ARGV[6])
if ARGV[7] == '1' then redis.call('SADD', p .. 'failed', id) end
return 1
"""

# ARGV: prefix. Running jobs whose lease lapsed (their replica died), queued again.
RECOVER = """
local p = ARGV[1]
local running = redis.call('HGETALL', p .. 'running')
local again = 0
for i = 1, #running, 2 do
  local id = running[i]
  if redis.call('EXISTS', p .. 'lease:' .. id) == 0 then
    redis.call('HDEL', p .. 'running', id)
    redis.call('HSET', p .. 'job:' .. id, 'status', '"queued"', 'progress', '0', 'step', '0')
    redis.call('ZADD', p .. 'queue', redis.call('HGET', p .. 'job:' .. id, 'created_at'), id)
    again = again + 1
  end
end
return again
"""

# ARGV: prefix, id, expires_at, then field, value pairs (status, error, expires_at). A queued or
# running job failed as cancelled, out of the queue or from its runner (whose next renewal and
# whose finish are refused: `running` no longer names it), said on the `cancels` channel so that
# its runner stops it now rather than at its next renewal; 1 if it was unfinished.
CANCEL = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'job:' .. id
if redis.call('SISMEMBER', p .. 'unfinished', id) == 0 then return 0 end
redis.call('ZREM', p .. 'queue', id)
redis.call('HDEL', p .. 'running', id)
redis.call('DEL', p .. 'lease:' .. id)
redis.call('HSET', key, unpack(ARGV, 4))
redis.call('SREM', p .. 'unfinished', id)
redis.call('SREM', p .. 'unfinished:' .. cjson.decode(redis.call('HGET', key, 'owner')), id)
redis.call('ZADD', p .. 'finished', ARGV[3], id)
redis.call('SADD', p .. 'failed', id)
redis.call('PUBLISH', p .. 'cancels', id)
return 1
"""

# ARGV: prefix, id. A finished job and its content gone; 1 if it was there.
DELETE = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'job:' .. id
local owner = redis.call('HGET', key, 'owner')
if not owner then return 0 end
redis.call('DECRBY', p .. 'bytes', tonumber(redis.call('HGET', key, 'bytes') or '0'))
for _, name in ipairs(redis.call('SMEMBERS', p .. 'files:' .. id)) do
  redis.call('DEL', p .. 'file:' .. id .. ':' .. name)
end
redis.call('DEL', key, p .. 'files:' .. id, p .. 'content:' .. id)  -- content: before 0.49's files
redis.call('ZREM', p .. 'jobs', id)
redis.call('ZREM', p .. 'owner:' .. cjson.decode(owner), id)
redis.call('ZREM', p .. 'finished', id)
redis.call('SREM', p .. 'failed', id)
return 1
"""


def connect(url: str) -> redis.Redis:
    """A client of the job store's Redis (the job store, the batch store and the webhooks' outbox
    each hold one): a refused connection (Redis restarting, a failover) tried again for ~1.5 s
    before a call fails, so each caller's commands must be safe to send twice; ConfigError naming
    the setting when it does not answer now."""
    again = Retry(ExponentialBackoff(cap=0.8, base=0.05), RETRIES, (redis.ConnectionError,))
    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5, retry=again)
    try:
        client.ping()
    except redis.RedisError as err:
        raise ConfigError(
            f"--job-store (DIFFSHARD_JOB_STORE): cannot reach Redis at {shown(url)}: {err}"
        ) from None
    return client


def encoded(job: VideoJob, *names: str) -> list[str]:
    """Field, JSON value pairs of `job` (of `names`; none: every field)."""
    values = asdict(job)
    return [part for name in names or FIELDS for part in (name, json.dumps(values[name]))]


class RedisJobStore:
    def __init__(self, url: str, model: str, lease_s: float) -> None:
        self.prefix = f"diffshard:{model}:"
        self.lease_ms = max(1, round(lease_s * 1000))
        self.upload_lapse_ms = max(UPLOAD_LAPSE_MS, 2 * self.lease_ms)
        self._closed = threading.Event()
        # every command here may be sent twice (`connect`'s retries): uploads write at an offset
        self._redis = connect(url)
        self._scripts = {
            name: self._redis.register_script(text)
            for name, text in [
                ("add", ADD),
                ("claim", CLAIM),
                ("progress", PROGRESS),
                ("release", RELEASE),
                ("finish", FINISH),
                ("recover", RECOVER),
                ("cancel", CANCEL),
                ("delete", DELETE),
            ]
        }

    def _run(self, script: str, *args: object) -> object:
        try:
            return self._scripts[script](args=[self.prefix, *args])
        except redis.RedisError as err:
            raise StoreUnavailable() from err

    def _call(self, method: str, *args: object) -> object:
        try:
            return getattr(self._redis, method)(*args)
        except redis.RedisError as err:
            raise StoreUnavailable() from err

    def add(
        self,
        job: VideoJob,
        per_owner: int | None = None,
        total: int | None = None,
        files: dict[str, bytes] | None = None,
    ) -> str | None:
        files = files or {}
        pairs = [x for k, v in asdict(job).items() for x in (k, json.dumps(v))]
        bounds = [-1 if b is None else b for b in (per_owner, total)]
        try:
            for name, data in files.items():
                self._upload(job.id, "create", name, data)
        except redis.RedisError as err:
            raise StoreUnavailable() from err
        refused = self._run("add", job.id, job.owner, job.created_at, *bounds, len(files), *files, *pairs)
        return None if refused is None else refused.decode() if isinstance(refused, bytes) else str(refused)

    def get(self, job_id: str) -> VideoJob | None:
        return self._decode(self._call("hgetall", f"{self.prefix}job:{job_id}"))

    @staticmethod
    def _decode(raw: object) -> VideoJob | None:
        if not raw:
            return None
        values = {k.decode(): json.loads(v) for k, v in raw.items()}  # type: ignore[union-attr]
        return VideoJob(**{k: v for k, v in values.items() if k in FIELDS})

    def page(
        self, owner: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[VideoJob], bool]:
        key = f"{self.prefix}jobs" if owner is None else f"{self.prefix}owner:{owner}"
        rank = "zrank" if order == "asc" else "zrevrank"
        start = 0
        if after is not None and (anchor := self._call(rank, key, after)) is not None:
            start = int(anchor) + 1  # type: ignore[call-overload]
        ids = self._call("zrange", key, start, start + limit, order != "asc")
        try:
            with self._redis.pipeline(transaction=False) as batch:
                for job_id in ids[:limit]:  # type: ignore[index]
                    batch.hgetall(f"{self.prefix}job:{job_id.decode()}")
                jobs = [job for raw in batch.execute() if (job := self._decode(raw)) is not None]
        except redis.RedisError as err:
            raise StoreUnavailable() from err
        return jobs, len(ids) > limit  # type: ignore[arg-type]

    def claim(self, worker: str) -> VideoJob | None:
        job_id = self._run("claim", worker, self.lease_ms)
        return None if job_id is None else self.get(job_id.decode())  # type: ignore[union-attr]

    def progress(self, job: VideoJob, worker: str) -> bool:
        """The job's progress written and its lease renewed, if `worker` still holds it."""
        changed = encoded(job, "progress", "step", "steps")
        return bool(self._run("progress", job.id, worker, self.lease_ms, *changed))

    def release(self, job: VideoJob, worker: str) -> bool:
        job.status, job.progress, job.step = "queued", 0, 0
        return bool(self._run("release", job.id, worker, *encoded(job, "status", "progress", "step")))

    def finish(self, job: VideoJob, worker: str, content: dict[str, bytes] | None) -> bool:
        content = content or {}
        changed = encoded(job, "status", "progress", "completed_at", "expires_at", "error", "bytes")
        try:
            for name, data in content.items():
                self._upload(job.id, worker, name, data)
            return bool(
                self._scripts["finish"](
                    args=[
                        self.prefix,
                        job.id,
                        worker,
                        job.owner,
                        job.expires_at or 0,
                        job.bytes,
                        int(job.status == "failed"),
                        *changed,
                        "--",
                        *content,
                    ]
                )
            )
        except redis.ResponseError as err:  # it answered, and said no: the same again says no again
            for name in content:
                with contextlib.suppress(redis.RedisError):
                    self._redis.delete(self._upload_key(job.id, worker, name))
            raise StoreRefused(refusal(err, job.bytes)) from err
        except redis.RedisError as err:
            raise StoreUnavailable() from err

    def _upload_key(self, job_id: str, worker: str, name: str) -> str:
        return f"{self.prefix}upload:{job_id}:{worker}:{name}"

    def _upload(self, job_id: str, worker: str, name: str, data: bytes) -> None:
        """`data` written a piece at a time, at its offset, to its upload key, which lapses unless
        FINISH keeps it."""
        key, view = self._upload_key(job_id, worker, name), memoryview(data)
        self._redis.delete(key)
        for offset in range(0, len(data), PIECE):
            with self._redis.pipeline(transaction=False) as batch:
                batch.setrange(key, offset, bytes(view[offset : offset + PIECE]))
                batch.pexpire(key, self.upload_lapse_ms)
                batch.execute()

    def recover(self) -> int:
        """Running jobs whose replica stopped renewing their lease, queued again; how many."""
        return int(self._run("recover"))  # type: ignore[call-overload]

    def cancel(self, job_id: str, expires_at: int) -> VideoJob | None:
        changed = ["status", '"failed"', "error", json.dumps(CANCELLED), "expires_at", str(expires_at)]
        self._run("cancel", job_id, expires_at, *changed)
        return self.get(job_id)

    def delete(self, job_id: str) -> bool:
        return bool(self._run("delete", job_id))

    def content(self, job_id: str, name: str) -> Content | None:
        key = f"{self.prefix}file:{job_id}:{name}"
        size = int(self._call("strlen", key))  # type: ignore[call-overload]
        if not size:
            return None
        return Content(size, lambda offset, length: self._call("getrange", key, offset, offset + length - 1))

    def unfinished(self, owner: str | None = None) -> int:
        key = f"{self.prefix}unfinished" if owner is None else f"{self.prefix}unfinished:{owner}"
        return int(self._call("scard", key))  # type: ignore[call-overload]

    def counts(self) -> dict[str, int]:
        p = self.prefix
        try:
            with self._redis.pipeline(transaction=False) as batch:
                batch.zcard(f"{p}queue").hlen(f"{p}running").zcard(f"{p}finished").scard(f"{p}failed")
                queued, running, finished, failed = batch.execute()
        except redis.RedisError as err:
            raise StoreUnavailable() from err
        return {"queued": queued, "in_progress": running, "completed": finished - failed, "failed": failed}

    def tidy(self, now: int, max_bytes: int) -> int:
        """Delete jobs past their `expires_at`, then the first to expire while the content
        holds more than `max_bytes`; how many went."""
        p, gone = self.prefix, 0
        for job_id in self._call("zrangebyscore", f"{p}finished", "-inf", now):  # type: ignore[union-attr]
            gone += self.delete(job_id.decode())
        while int(self._call("get", f"{p}bytes") or 0) > max_bytes:  # type: ignore[arg-type]
            first = self._call("zrange", f"{p}finished", 0, 0)
            if not first:
                break
            gone += self.delete(first[0].decode())  # type: ignore[index]
        return gone

    def on_cancel(self, stop: Callable[[str], None]) -> None:
        """`stop(job_id)` called, on a thread of its own, for each job any replica cancels: a
        message (a job cancelled while this replica does not hear it is still stopped, at its
        runner's next renewal, which the store refuses)."""
        thread = threading.Thread(target=self._hear, args=(stop,), name="diffshard-cancels", daemon=True)
        thread.start()

    def _hear(self, stop: Callable[[str], None]) -> None:
        while not self._closed.is_set():
            try:
                with self._redis.pubsub(ignore_subscribe_messages=True) as channel:
                    channel.subscribe(f"{self.prefix}cancels")
                    while not self._closed.is_set():
                        if (message := channel.get_message(timeout=1.0)) is not None:
                            stop(message["data"].decode())
            except redis.RedisError:  # Redis restarting: listen again once it answers
                self._closed.wait(1.0)
            except Exception:  # a bug here must not end the listening
                log.exception("video jobs: hearing cancels failed")
                self._closed.wait(1.0)

    def close(self) -> None:
        self._closed.set()
        self._redis.close()


def refusal(err: redis.ResponseError, size: int) -> str:
    """What to tell the job's client when Redis will not keep its content: the limit it met."""
    said = str(err)
    if "maxmemory" in said:
        limit = "the job store's memory limit (Redis maxmemory)"
    elif "maximum allowed size" in said or "max_bulk_len" in said:
        limit = "the job store's largest value (Redis proto-max-bulk-len)"
    else:
        limit = "the job store's limits"
    return (
        f"the video's content ({size / 2**20:.1f} MiB) is over {limit}: ask for fewer frames or a "
        "smaller size, or ask the operator for room"
    )
