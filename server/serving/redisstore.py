"""Video jobs in one Redis that several replicas share (`--job-store redis://host:port/db`):
any replica answers any job's status and content, jobs are taken from one queue exactly once,
and a job whose replica died runs again elsewhere once its lease lapses.

Keys, under `diffshard:<model>:` (models sharing a Redis take only their own jobs):
  job:<id>        hash, the VideoJob's fields each as JSON
  content:<id>    hash, file name → bytes (MP4, frames ZIP, thumbnail, spritesheet)
  jobs, owner:<o> sorted sets of ids by created_at (listing, paging)
  queue           sorted set of queued ids by created_at
  running         hash, id → the worker holding it;  lease:<id> that worker, expiring
  unfinished, unfinished:<o>, failed   sets;  finished  sorted set by expires_at;  bytes  a count
  turns           hash, owner → its last claim's number from `turn` (a count): claims go round owners
Every move between states is one Lua script, so replicas never see a job half moved. One Redis,
not a cluster: the scripts name keys they derive.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import redis

from server.errors import ConfigError, StoreUnavailable
from server.serving.videostore import VideoJob, shown

FIELDS = [f.name for f in fields(VideoJob)]

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

# ARGV: prefix, id, owner, created_at, the owner's bound, the store's (-1: none), then field,
# value pairs. Counted and added as one: concurrent creates never pass a bound together.
ADD = """
local p, id, owner, at = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local per_owner, total = tonumber(ARGV[5]), tonumber(ARGV[6])
if per_owner >= 0 and redis.call('SCARD', p .. 'unfinished:' .. owner) >= per_owner then return 'owner' end
if total >= 0 and redis.call('SCARD', p .. 'unfinished') >= total then return 'total' end
redis.call('HSET', p .. 'job:' .. id, unpack(ARGV, 7))
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
# then '--', then content name, bytes pairs. Completed or failed, if `worker` holds it.
FINISH = """
local p, id = ARGV[1], ARGV[2]
if redis.call('HGET', p .. 'running', id) ~= ARGV[3] then return 0 end
redis.call('HDEL', p .. 'running', id)
redis.call('DEL', p .. 'lease:' .. id)
local split = 8
while ARGV[split] ~= '--' do split = split + 1 end
redis.call('HSET', p .. 'job:' .. id, unpack(ARGV, 8, split - 1))
if #ARGV > split then redis.call('HSET', p .. 'content:' .. id, unpack(ARGV, split + 1)) end
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

# ARGV: prefix, id. A finished job and its content gone; 1 if it was there.
DELETE = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'job:' .. id
local owner = redis.call('HGET', key, 'owner')
if not owner then return 0 end
redis.call('DECRBY', p .. 'bytes', tonumber(redis.call('HGET', key, 'bytes') or '0'))
redis.call('DEL', key, p .. 'content:' .. id)
redis.call('ZREM', p .. 'jobs', id)
redis.call('ZREM', p .. 'owner:' .. cjson.decode(owner), id)
redis.call('ZREM', p .. 'finished', id)
redis.call('SREM', p .. 'failed', id)
return 1
"""


def encoded(job: VideoJob, *names: str) -> list[str]:
    """Field, JSON value pairs of `job` (of `names`; none: every field)."""
    values = asdict(job)
    return [part for name in names or FIELDS for part in (name, json.dumps(values[name]))]


class RedisJobStore:
    def __init__(self, url: str, model: str, lease_s: float) -> None:
        self.prefix = f"diffshard:{model}:"
        self.lease_ms = max(1, round(lease_s * 1000))
        self._redis = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        try:
            self._redis.ping()
        except redis.RedisError as err:
            raise ConfigError(
                f"--job-store (DIFFSHARD_JOB_STORE): cannot reach Redis at {shown(url)}: {err}"
            ) from None
        self._scripts = {
            name: self._redis.register_script(text)
            for name, text in [("add", ADD), ("claim", CLAIM), ("progress", PROGRESS), ("release", RELEASE),
                               ("finish", FINISH), ("recover", RECOVER), ("delete", DELETE)]
        }  # fmt: skip

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

    def add(self, job: VideoJob, per_owner: int | None = None, total: int | None = None) -> str | None:
        pairs = [x for k, v in asdict(job).items() for x in (k, json.dumps(v))]
        bounds = [-1 if b is None else b for b in (per_owner, total)]
        refused = self._run("add", job.id, job.owner, job.created_at, *bounds, *pairs)
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
        files = [part for name, data in (content or {}).items() for part in (name, data)]
        changed = encoded(job, "status", "progress", "completed_at", "expires_at", "error", "bytes")
        return bool(self._run(
            "finish", job.id, worker, job.owner, job.expires_at or 0, job.bytes,
            int(job.status == "failed"), *changed, "--", *files,
        ))  # fmt: skip

    def recover(self) -> int:
        """Running jobs whose replica stopped renewing their lease, queued again; how many."""
        return int(self._run("recover"))  # type: ignore[call-overload]

    def delete(self, job_id: str) -> bool:
        return bool(self._run("delete", job_id))

    def content(self, job_id: str, name: str) -> bytes | None:
        return self._call("hget", f"{self.prefix}content:{job_id}", name)  # type: ignore[return-value]

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

    def close(self) -> None:
        self._redis.close()
