"""OpenAI's Batch API (issue 73). The store on a real SQLite file and a real redis-server: lines
claimed once, fairly between keys, a lapsed lease's line queued again, cancel dropping queued
lines, one closer. Then the built-in model served by uvicorn, driven by the openai SDK unchanged:
files.create, batches.create, poll to completed, the output file's lines each equal to the same
request sent alone; a bad line an error line naming its field; a malformed file refused naming
its line; another key's batch a 404; cancel; expiry; a batch cut short by a restart completing
after it, no line twice."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.serving.batchstore import Batch, BatchStore, LineInput, StoredFile, new_id, open_batch_store
from tests.support.redis_server import redis_server
from tests.support.waiting import wait_until

LEASE_S = 30.0


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BatchStore]:
    """Model "m"'s batch store in a SQLite file of this test's, or in a real redis-server of its own."""
    with contextlib.ExitStack() as stack:
        if request.param == "redis":
            url = stack.enter_context(redis_server(tmp_path)).url
        else:
            url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
        opened = open_batch_store(url, "m")
        yield opened
        opened.close_store()


def a_batch(owner: str, lines: int, created_at: int = 100) -> tuple[Batch, list[LineInput]]:
    batch = Batch(new_id("batch_"), owner, "m", "/v1/images/generations", "file-x", "24h", created_at, 10**9)
    batch.total = lines
    body = json.dumps({"prompt": "a red circle"})
    return batch, [LineInput(f"{owner}-{i}", "/v1/images/generations", body) for i in range(lines)]


def test_a_file_is_kept_within_the_stores_bytes_and_listed_by_owner_and_purpose(store: BatchStore) -> None:
    first = StoredFile(new_id("file-"), "a", "in.jsonl", "batch", 5, 10, 1000)
    assert store.add_file(first, b"hello", max_bytes=8)
    assert not store.add_file(StoredFile(new_id("file-"), "a", "x", "batch", 5, 11, 1000), b"world", 8)
    second = StoredFile(new_id("file-"), "b", "in.jsonl", "batch", 3, 12, 1000)
    assert store.add_file(second, b"abc", max_bytes=8)
    assert store.get_file(first.id) == first
    content = store.file_content(first.id)
    read = content.read_bytes() if isinstance(content, Path) else b"".join(content.pieces())
    assert read == b"hello"
    assert [f.id for f in store.page_files(None, None, 10, "desc", None)[0]] == [second.id, first.id]
    assert store.page_files("a", None, 10, "desc", None) == ([first], False)
    assert store.page_files(None, None, 1, "asc", None) == ([first], True)
    assert store.page_files(None, first.id, 1, "asc", None) == ([second], False)
    assert store.page_files(None, None, 10, "desc", "batch_output") == ([], False)
    assert store.tidy(1000, max_bytes=100, keep_s=0) == 2  # expired
    assert store.get_file(first.id) is None and store.file_content(first.id) is None


def test_claims_go_round_the_keys_and_each_line_is_held_once(store: BatchStore) -> None:
    long, _ = a_batch("a", 0)
    long_batch, long_lines = a_batch("a", 4, created_at=1)
    short_batch, short_lines = a_batch("b", 2, created_at=2)
    assert store.add_batch(long_batch, long_lines, per_owner=2)
    assert store.add_batch(short_batch, short_lines, per_owner=2)
    assert store.add_batch(a_batch("a", 1)[0], a_batch("a", 1)[1], per_owner=2)
    assert not store.add_batch(long, [], per_owner=2)  # a's third unfinished batch
    claimed = [store.claim("w", 0, LEASE_S) for _ in range(6)]
    assert all(line is not None for line in claimed)
    owners = [line.owner for line in claimed if line]
    assert owners[:4] == ["a", "b", "a", "b"]  # b's short batch is not held up by a's long one
    keys = {line.key for line in claimed if line}
    assert len(keys) == 6
    assert store.renew("w", keys, 0, LEASE_S) == set()
    assert store.renew("other", keys, 0, LEASE_S) == keys


def test_a_result_is_kept_only_by_its_holder_and_a_lapsed_line_runs_again(store: BatchStore) -> None:
    batch, lines = a_batch("a", 2)
    store.add_batch(batch, lines, per_owner=None)
    first = store.claim("dead", 0, lease_s=0.001)
    assert first is not None and first.input == lines[0]
    assert wait_until(lambda: store.recover(now=1), 5, "the lapsed line queued again") == 1
    again = store.claim("alive", 1, LEASE_S)
    assert again is not None and again.key == first.key
    assert not store.finish("dead", first.key, b"late", failed=False)
    assert store.finish("alive", again.key, b"made", failed=False)
    second = store.claim("alive", 1, LEASE_S)
    assert second is not None and store.release("alive", second.key)  # given back: queued again
    assert store.take_close(batch.id, "alive", 1, LEASE_S) is None  # a line is queued
    second = store.claim("alive", 1, LEASE_S)
    assert store.finish("alive", second.key, b"bad", failed=True)
    assert store.claim("alive", 1, LEASE_S) is None
    closing = store.take_close(batch.id, "alive", 1, LEASE_S)
    assert closing is not None and closing.status == "finalizing"
    assert (closing.completed, closing.failed) == (1, 1)
    assert store.take_close(batch.id, "other", 1, LEASE_S) is None  # one closer
    results = [(r.index, r.text, r.failed) for r in store.results(batch.id)]
    assert results == [(0, b"made", False), (1, b"bad", True)]
    out = StoredFile(new_id("file-"), "a", "out.jsonl", "batch_output", 0, 2, 10**9)
    closing.status, closing.completed_at, closing.output_file_id = "completed", 2, out.id
    assert not store.close(closing, "other", [(out, [b"x"])])
    assert store.close(closing, "alive", [(out, [b"made", b"\n"])])
    done = store.get_batch(batch.id)
    assert done is not None and (done.status, done.output_file_id) == ("completed", out.id)
    stored = store.get_file(out.id)
    assert stored is not None and stored.bytes == 5
    assert store.unfinished() == []


def test_cancel_drops_the_queued_lines_and_stops_the_running_ones(store: BatchStore) -> None:
    batch, lines = a_batch("a", 3)
    store.add_batch(batch, lines, per_owner=None)
    running = store.claim("w", 0, LEASE_S)
    assert running is not None
    stopped = store.stop(batch.id, "cancel", now=5)
    assert stopped is not None and (stopped.status, stopped.cancelling_at) == ("cancelling", 5)
    assert store.claim("w", 0, LEASE_S) is None  # queued lines never start
    assert store.renew("w", [running.key], 0, LEASE_S) == {running.key}  # the runner cancels it
    assert store.take_close(batch.id, "w", 0, LEASE_S) is None  # it is still held
    assert store.release("w", running.key)  # dropped, not queued again
    assert store.claim("w", 0, LEASE_S) is None
    closing = store.take_close(batch.id, "w", 0, LEASE_S)
    assert closing is not None and closing.status == "cancelling"
    assert [r.text for r in store.results(batch.id)] == [None, None, None]
