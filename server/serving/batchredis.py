"""The Batch API's store in the Redis that replicas share (`--job-store redis://…`): any replica
answers any file or batch, takes any batch's next line, and closes a batch whose closer died.

Keys, under `diffshard:<model>:batches:`:
  file:<id>        a file's record (JSON);  content:<id>  its bytes, written and read in pieces
  files, files:<o> sorted sets of file ids by created_at;  fexpiry  by expires_at;  bytes  a count
  batch:<id>       hash, the Batch's fields each as JSON
  batches, batches:<o>  sorted sets of batch ids by created_at;  ended  by the time each ended
  unfinished, unfinished:<o>  sets of batch ids in progress, finalizing or cancelling
  lines:<id>       hash, line → its input (JSON);  queued:<id>  sorted set of queued lines
  active           sorted set of the batches with lines queued, by created_at
  held:<id>        hash, line → the worker running it;  lease:<id>:<line>  that worker, expiring
  holding          set of the batches with lines running
  results:<id>     hash, line → its output or error line;  failures:<id>  the lines whose is an error
  closer:<id>      the worker writing its files, expiring
  turns            hash, owner → its last claim's number from `turn` (a count): claims go round owners
Every move is one Lua script. One Redis, not a cluster: the scripts name keys they derive.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, fields
from typing import Any

import redis

from server.errors import StoreUnavailable
from server.serving.batchstore import UNFINISHED, Batch, Line, LineInput, Result, StoredFile
from server.serving.redisstore import UPLOAD_LAPSE_MS, connect
from server.serving.videostore import PIECE, Content

BATCH_FIELDS = [f.name for f in fields(Batch)]
LINES_AT_ONCE = 64  # lines read or written in one round trip
FILE_ARGS = 6  # a file's arguments to CLOSE: id, record, created_at, expires_at, bytes, owner

ADD_FILE = """
local p, id = ARGV[1], ARGV[2]
local size = tonumber(ARGV[6])
if tonumber(redis.call('GET', p .. 'bytes') or '0') + size > tonumber(ARGV[7]) then
  redis.call('DEL', ARGV[8])
  return 0
end
if size > 0 then
  redis.call('RENAME', ARGV[8], p .. 'content:' .. id)
  redis.call('PERSIST', p .. 'content:' .. id)
end
redis.call('SET', p .. 'file:' .. id, ARGV[9])
redis.call('ZADD', p .. 'files', ARGV[4], id)
redis.call('ZADD', p .. 'files:' .. ARGV[3], ARGV[4], id)
redis.call('ZADD', p .. 'fexpiry', ARGV[5], id)
redis.call('INCRBY', p .. 'bytes', size)
return 1
"""

DELETE_FILE = """
local p, id = ARGV[1], ARGV[2]
local record = redis.call('GET', p .. 'file:' .. id)
if not record then return 0 end
local file = cjson.decode(record)
redis.call('DECRBY', p .. 'bytes', file.bytes)
redis.call('DEL', p .. 'file:' .. id, p .. 'content:' .. id)
redis.call('ZREM', p .. 'files', id)
redis.call('ZREM', p .. 'files:' .. file.owner, id)
redis.call('ZREM', p .. 'fexpiry', id)
return 1
"""

# ARGV: prefix, id, owner, created_at, the owner's bound (-1: none), lines, unfinished (1/0), then
# field, value pairs. Its lines (lines:<id>) are written before; counted and added as one.
ADD_BATCH = """
local p, id, owner, at = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local per_owner, n, open = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] == '1'
if open and per_owner >= 0 and redis.call('SCARD', p .. 'unfinished:' .. owner) >= per_owner then
  redis.call('DEL', p .. 'lines:' .. id)
  return 0
end
redis.call('HSET', p .. 'batch:' .. id, unpack(ARGV, 8))
redis.call('ZADD', p .. 'batches', at, id)
redis.call('ZADD', p .. 'batches:' .. owner, at, id)
if not open then
  redis.call('ZADD', p .. 'ended', at, id)
  redis.call('DEL', p .. 'lines:' .. id)
  return 1
end
redis.call('SADD', p .. 'unfinished', id)
redis.call('SADD', p .. 'unfinished:' .. owner, id)
for i = 0, n - 1 do redis.call('ZADD', p .. 'queued:' .. id, i, i) end
redis.call('ZADD', p .. 'active', at, id)
return 1
"""

# ARGV: prefix, worker, lease ms. The next line of the batch whose owner's last turn is oldest.
CLAIM = """
local p = ARGV[1]
local best, owner, last
for _, id in ipairs(redis.call('ZRANGE', p .. 'active', 0, -1)) do
  local whose = redis.call('HGET', p .. 'batch:' .. id, 'owner')
  local turn = tonumber(redis.call('HGET', p .. 'turns', whose) or '0')
  if best == nil or turn < last then best, owner, last = id, whose, turn end
end
if not best then return false end
local popped = redis.call('ZPOPMIN', p .. 'queued:' .. best)
if redis.call('ZCARD', p .. 'queued:' .. best) == 0 then redis.call('ZREM', p .. 'active', best) end
if #popped == 0 then return false end
local line = popped[1]
redis.call('HSET', p .. 'held:' .. best, line, ARGV[2])
redis.call('SET', p .. 'lease:' .. best .. ':' .. line, ARGV[2], 'PX', ARGV[3])
redis.call('SADD', p .. 'holding', best)
redis.call('HSET', p .. 'turns', owner, redis.call('INCR', p .. 'turn'))
local input = redis.call('HGET', p .. 'lines:' .. best, line)
return {best, line, input, owner, redis.call('HGET', p .. 'batch:' .. best, 'expires_at')}
"""

# ARGV: prefix, worker, lease ms, then batch, line pairs. The pairs no longer to run, flattened.
RENEW = """
local p, worker = ARGV[1], ARGV[2]
local lost = {}
for i = 4, #ARGV, 2 do
  local id, line = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', p .. 'held:' .. id, line) == worker
      and redis.call('HGET', p .. 'batch:' .. id, 'stopped') == 'null' then
    redis.call('SET', p .. 'lease:' .. id .. ':' .. line, worker, 'PX', ARGV[3])
  else
    table.insert(lost, id)
    table.insert(lost, line)
  end
end
return lost
"""

# A held line let go (KEYS: none): back to its batch's queue unless the batch was stopped.
LET_GO = """
local function let_go(p, id, line)
  redis.call('HDEL', p .. 'held:' .. id, line)
  redis.call('DEL', p .. 'lease:' .. id .. ':' .. line)
  if redis.call('HLEN', p .. 'held:' .. id) == 0 then redis.call('SREM', p .. 'holding', id) end
end
local function requeue(p, id, line)
  local batch = p .. 'batch:' .. id
  if redis.call('HGET', batch, 'stopped') ~= 'null' then return end
  redis.call('ZADD', p .. 'queued:' .. id, line, line)
  redis.call('ZADD', p .. 'active', redis.call('HGET', batch, 'created_at'), id)
end
"""

# ARGV: prefix, batch, line, worker, failed (1/0), the result.
FINISH = (
    LET_GO
    + """
local p, id, line = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', p .. 'held:' .. id, line) ~= ARGV[4] then return 0 end
let_go(p, id, line)
redis.call('HSET', p .. 'results:' .. id, line, ARGV[6])
if ARGV[5] == '1' then
  redis.call('SADD', p .. 'failures:' .. id, line)
  redis.call('HINCRBY', p .. 'batch:' .. id, 'failed', 1)
else
  redis.call('HINCRBY', p .. 'batch:' .. id, 'completed', 1)
end
return 1
"""
)

# ARGV: prefix, batch, line, worker.
RELEASE = (
    LET_GO
    + """
local p, id, line = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', p .. 'held:' .. id, line) ~= ARGV[4] then return 0 end
let_go(p, id, line)
requeue(p, id, line)
return 1
"""
)

# ARGV: prefix. Held lines whose lease lapsed (their replica died), queued again.
RECOVER = (
    LET_GO
    + """
local p = ARGV[1]
local again = 0
for _, id in ipairs(redis.call('SMEMBERS', p .. 'holding')) do
  local held = redis.call('HGETALL', p .. 'held:' .. id)
  for i = 1, #held, 2 do
    if redis.call('EXISTS', p .. 'lease:' .. id .. ':' .. held[i]) == 0 then
      let_go(p, id, held[i])
      requeue(p, id, held[i])
      again = again + 1
    end
  end
  if redis.call('HLEN', p .. 'held:' .. id) == 0 then redis.call('SREM', p .. 'holding', id) end
end
return again
"""
)

# ARGV: prefix, batch, why ("cancel" or "expire"), now.
STOP = """
local p, id, why = ARGV[1], ARGV[2], ARGV[3]
local batch = p .. 'batch:' .. id
if redis.call('SISMEMBER', p .. 'unfinished', id) == 0 then return 0 end
if redis.call('HGET', batch, 'stopped') ~= 'null' then return 0 end
if why == 'cancel' and redis.call('HGET', batch, 'status') == '"finalizing"' then return 0 end
redis.call('HSET', batch, 'stopped', '"' .. why .. '"')
if why == 'cancel' then redis.call('HSET', batch, 'status', '"cancelling"', 'cancelling_at', ARGV[4]) end
redis.call('DEL', p .. 'queued:' .. id)
redis.call('ZREM', p .. 'active', id)
return 1
"""

# ARGV: prefix, batch, worker, now, lease ms.
TAKE_CLOSE = """
local p, id, worker = ARGV[1], ARGV[2], ARGV[3]
local batch = p .. 'batch:' .. id
if redis.call('SISMEMBER', p .. 'unfinished', id) == 0 then return 0 end
if redis.call('ZCARD', p .. 'queued:' .. id) > 0 then return 0 end
if redis.call('HLEN', p .. 'held:' .. id) > 0 then return 0 end
local closer = redis.call('GET', p .. 'closer:' .. id)
if closer and closer ~= worker then return 0 end
redis.call('SET', p .. 'closer:' .. id, worker, 'PX', ARGV[5])
local running = redis.call('HGET', batch, 'status') == '"in_progress"'
if running and redis.call('HGET', batch, 'stopped') == 'null' then
  redis.call('HSET', batch, 'status', '"finalizing"', 'finalizing_at', ARGV[4])
end
return 1
"""

# ARGV: prefix, batch, worker, owner, ended_at, files, then FILE_ARGS a file, then field, value pairs.
CLOSE = """
local p, id, worker = ARGV[1], ARGV[2], ARGV[3]
local files = tonumber(ARGV[6])
if redis.call('GET', p .. 'closer:' .. id) ~= worker then
  for f = 0, files - 1 do redis.call('DEL', p .. 'upload:' .. ARGV[7 + f * 6] .. ':' .. worker) end
  return 0
end
for f = 0, files - 1 do
  local at = 7 + f * 6
  local fid = ARGV[at]
  redis.call('RENAME', p .. 'upload:' .. fid .. ':' .. worker, p .. 'content:' .. fid)
  redis.call('PERSIST', p .. 'content:' .. fid)
  redis.call('SET', p .. 'file:' .. fid, ARGV[at + 1])
  redis.call('ZADD', p .. 'files', ARGV[at + 2], fid)
  redis.call('ZADD', p .. 'files:' .. ARGV[at + 5], ARGV[at + 2], fid)
  redis.call('ZADD', p .. 'fexpiry', ARGV[at + 3], fid)
  redis.call('INCRBY', p .. 'bytes', ARGV[at + 4])
end
redis.call('HSET', p .. 'batch:' .. id, unpack(ARGV, 7 + files * 6))
redis.call('SREM', p .. 'unfinished', id)
redis.call('SREM', p .. 'unfinished:' .. ARGV[4], id)
redis.call('ZADD', p .. 'ended', ARGV[5], id)
for _, name in ipairs({'lines:', 'results:', 'failures:', 'queued:', 'held:', 'closer:'}) do
  redis.call('DEL', p .. name .. id)
end
return 1
"""

# ARGV: prefix, batch. An ended batch's record gone.
DELETE_BATCH = """
local p, id = ARGV[1], ARGV[2]
local owner = redis.call('HGET', p .. 'batch:' .. id, 'owner')
redis.call('ZREM', p .. 'ended', id)
if not owner then return 0 end
redis.call('DEL', p .. 'batch:' .. id)
redis.call('ZREM', p .. 'batches', id)
redis.call('ZREM', p .. 'batches:' .. cjson.decode(owner), id)
return 1
"""

SCRIPTS = {
    "add_file": ADD_FILE,
    "delete_file": DELETE_FILE,
    "add_batch": ADD_BATCH,
    "claim": CLAIM,
    "renew": RENEW,
    "finish": FINISH,
    "release": RELEASE,
    "recover": RECOVER,
    "stop": STOP,
    "take_close": TAKE_CLOSE,
    "close": CLOSE,
    "delete_batch": DELETE_BATCH,
}


def pairs(batch: Batch) -> list[str]:
    return [part for name, value in asdict(batch).items() for part in (name, json.dumps(value))]


class RedisBatchStore:
    def __init__(self, url: str, model: str) -> None:
        self.prefix = f"diffshard:{model}:batches:"
        self._redis = connect(url)
        self._scripts = {name: self._redis.register_script(text) for name, text in SCRIPTS.items()}

    def _run(self, script: str, *args: object) -> Any:
        try:
            return self._scripts[script](args=[self.prefix, *args])
        except redis.RedisError as err:
            raise StoreUnavailable() from err

    def _call(self, method: str, *args: object) -> Any:
        try:
            return getattr(self._redis, method)(*args)
        except redis.RedisError as err:
            raise StoreUnavailable() from err

    def _upload(self, key: str, pieces: Iterable[bytes]) -> int:
        """`pieces` written one after another at their offset into `key`, which lapses unless a
        script keeps it; the bytes written."""
        self._redis.delete(key)
        size = 0
        for data in pieces:
            view = memoryview(data)
            for offset in range(0, len(data), PIECE):
                with self._redis.pipeline(transaction=False) as batch:
                    batch.setrange(key, size + offset, bytes(view[offset : offset + PIECE]))
                    batch.pexpire(key, UPLOAD_LAPSE_MS)
                    batch.execute()
            size += len(data)
        return size

    # Files.

    def add_file(self, file: StoredFile, content: bytes, max_bytes: int) -> bool:
        key = f"{self.prefix}upload:{file.id}:create"
        record = json.dumps(asdict(file))
        try:
            self._upload(key, [content])
        except redis.RedisError as err:
            raise StoreUnavailable() from err
        expires = file.expires_at or 0
        added = self._run(
            "add_file", file.id, file.owner, file.created_at, expires, file.bytes, max_bytes, key, record
        )
        return bool(added)

    def get_file(self, file_id: str) -> StoredFile | None:
        record = self._call("get", f"{self.prefix}file:{file_id}")
        return None if record is None else StoredFile.decode(record)

    def file_content(self, file_id: str) -> Content | None:
        key = f"{self.prefix}content:{file_id}"
        size = int(self._call("strlen", key))
        if not size:
            return None
        return Content(size, lambda offset, length: self._call("getrange", key, offset, offset + length - 1))

    def _page_ids(self, key: str, after: str | None, limit: int, order: str) -> list[str]:
        rank = "zrank" if order == "asc" else "zrevrank"
        start = 0
        if after is not None and (anchor := self._call(rank, key, after)) is not None:
            start = int(anchor) + 1
        return [i.decode() for i in self._call("zrange", key, start, start + limit, order != "asc")]

    def page_files(
        self, owner: str | None, after: str | None, limit: int, order: str, purpose: str | None
    ) -> tuple[list[StoredFile], bool]:
        key = f"{self.prefix}files" if owner is None else f"{self.prefix}files:{owner}"
        found: list[StoredFile] = []
        while True:  # a purpose filters the ids read: read on until the page is full or none are left
            ids = self._page_ids(key, after, limit - len(found), order)
            taken = ids[: limit - len(found)]
            for record in self._call("mget", [f"{self.prefix}file:{i}" for i in taken]) if taken else []:
                if record is not None and purpose in (None, (file := StoredFile.decode(record)).purpose):
                    found.append(file)
            if len(ids) <= len(taken) or len(found) >= limit:
                return found, len(ids) > len(taken)
            after = taken[-1]

    def delete_file(self, file_id: str) -> bool:
        return bool(self._run("delete_file", file_id))

    # Batches.

    def add_batch(self, batch: Batch, lines: list[LineInput], per_owner: int | None) -> bool:
        key, is_open = f"{self.prefix}lines:{batch.id}", batch.status in UNFINISHED
        try:
            if is_open:
                for start in range(0, len(lines), LINES_AT_ONCE):
                    chunk = lines[start : start + LINES_AT_ONCE]
                    self._redis.hset(key, mapping={start + i: line.encoded() for i, line in enumerate(chunk)})
        except redis.RedisError as err:
            raise StoreUnavailable() from err
        bound = -1 if per_owner is None else per_owner
        added = self._run(
            "add_batch",
            batch.id,
            batch.owner,
            batch.created_at,
            bound,
            len(lines),
            int(is_open),
            *pairs(batch),
        )
        return bool(added)

    @staticmethod
    def _decode(raw: dict) -> Batch | None:
        if not raw:
            return None
        return Batch.decode({k.decode(): json.loads(v) for k, v in raw.items()})

    def get_batch(self, batch_id: str) -> Batch | None:
        return self._decode(self._call("hgetall", f"{self.prefix}batch:{batch_id}"))

    def _batches(self, ids: list[str]) -> list[Batch]:
        try:
            with self._redis.pipeline(transaction=False) as batch:
                for batch_id in ids:
                    batch.hgetall(f"{self.prefix}batch:{batch_id}")
                return [b for raw in batch.execute() if (b := self._decode(raw)) is not None]
        except redis.RedisError as err:
            raise StoreUnavailable() from err

    def page_batches(
        self, owner: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[Batch], bool]:
        key = f"{self.prefix}batches" if owner is None else f"{self.prefix}batches:{owner}"
        ids = self._page_ids(key, after, limit, order)
        return self._batches(ids[:limit]), len(ids) > limit

    def unfinished(self) -> list[Batch]:
        ids = sorted(i.decode() for i in self._call("smembers", f"{self.prefix}unfinished"))
        return sorted(self._batches(ids), key=lambda b: b.created_at)

    # Lines.

    def claim(self, worker: str, now: float, lease_s: float) -> Line | None:
        claimed = self._run("claim", worker, max(1, round(lease_s * 1000)))
        if not claimed:
            return None
        batch_id, line, text, owner, expires_at = claimed
        return Line(batch_id.decode(), int(line), LineInput.decode(text), json.loads(owner), int(expires_at))

    def renew(self, worker: str, keys: Iterable[tuple[str, int]], now: float, lease_s: float) -> set:
        flat = [part for batch_id, line in keys for part in (batch_id, line)]
        if not flat:
            return set()
        lost = self._run("renew", worker, max(1, round(lease_s * 1000)), *flat)
        return {(lost[i].decode(), int(lost[i + 1])) for i in range(0, len(lost), 2)}

    def finish(self, worker: str, key: tuple[str, int], text: bytes, failed: bool) -> bool:
        return bool(self._run("finish", *key, worker, int(failed), text))

    def release(self, worker: str, key: tuple[str, int]) -> bool:
        return bool(self._run("release", *key, worker))

    def recover(self, now: float) -> int:
        return int(self._run("recover"))

    def stop(self, batch_id: str, why: str, now: int) -> Batch | None:
        self._run("stop", batch_id, why, now)
        return self.get_batch(batch_id)

    def take_close(self, batch_id: str, worker: str, now: float, lease_s: float) -> Batch | None:
        taken = self._run("take_close", batch_id, worker, int(now), max(1, round(lease_s * 1000)))
        return self.get_batch(batch_id) if taken else None

    def results(self, batch_id: str) -> Iterator[Result]:
        p = self.prefix
        count = int(self._call("hlen", f"{p}lines:{batch_id}"))
        failures = {int(i) for i in self._call("smembers", f"{p}failures:{batch_id}")}
        for start in range(0, count, LINES_AT_ONCE):
            indices = list(range(start, min(count, start + LINES_AT_ONCE)))
            inputs = self._call("hmget", f"{p}lines:{batch_id}", indices)
            texts = self._call("hmget", f"{p}results:{batch_id}", indices)
            for index, text, result in zip(indices, inputs, texts, strict=True):
                yield Result(index, LineInput.decode(text), result, index in failures)

    def close(self, batch: Batch, worker: str, files: list[tuple[StoredFile, Iterable[bytes]]]) -> bool:
        args: list[object] = []
        try:
            for file, pieces in files:
                file.bytes = self._upload(f"{self.prefix}upload:{file.id}:{worker}", pieces)
                record = json.dumps(asdict(file))
                args += [file.id, record, file.created_at, file.expires_at or 0, file.bytes, file.owner]
        except redis.RedisError as err:
            raise StoreUnavailable() from err
        ended = batch.ended_at or batch.created_at
        return bool(
            self._run("close", batch.id, worker, batch.owner, ended, len(files), *args, *pairs(batch))
        )

    # Housekeeping.

    def tidy(self, now: int, max_bytes: int, keep_s: int) -> int:
        p, gone = self.prefix, 0
        for file_id in self._call("zrangebyscore", f"{p}fexpiry", 1, now):  # 0: never expires
            gone += self.delete_file(file_id.decode())
        while int(self._call("get", f"{p}bytes") or 0) > max_bytes:
            first = self._call("zrange", f"{p}fexpiry", 0, 0)
            if not first:
                break
            gone += self.delete_file(first[0].decode())
        for batch_id in self._call("zrangebyscore", f"{p}ended", "-inf", now - keep_s):
            gone += int(self._run("delete_batch", batch_id.decode()))
        return gone

    def close_store(self) -> None:
        self._redis.close()
