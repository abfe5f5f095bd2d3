"""OpenAI's Batch API (issue 73). The store on a real SQLite file and a real redis-server: lines
claimed once, fairly between keys, a lapsed lease's line queued again, cancel dropping queued
lines, one closer. Then the built-in model served by uvicorn, driven by the openai SDK unchanged:
files.create, batches.create, poll to completed, the output file's lines each equal to the same
request sent alone; a bad line an error line naming its field; a malformed file refused naming
its line; another key's batch a 404; cancel; expiry; a batch cut short by a restart completing
after it, no line twice."""

from __future__ import annotations

import base64
import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types import Batch as SdkBatch
from PIL import Image, ImageDraw

from server.serving.batches import confirm_batch, open_batch_store
from server.serving.batchstore import Batch, BatchStore, LineInput, StoredFile, new_id
from server.serving.outbox import event_for
from tests.support.live import LiveServer, live_server
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


# The built-in model over HTTP, driven by the openai SDK.

ENDED = ("completed", "failed", "expired", "cancelled")
FAST = {"size": "64x64", "num_inference_steps": 3, "deterministic": True}
KEYS = ("sk-first", "sk-second")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the module's SDK tests: two keys, a job store of its own, and room for one
    line at a time beside interactive requests (2 rows: a guided line), so a batch is seen running."""
    folder = tmp_path_factory.mktemp("batches")
    keys = folder / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    store = f"sqlite:///{folder / 'jobs.sqlite'}"
    args = ("--job-store", store, "--api-key-file", str(keys), "--batch-rows-in-flight", "2")
    with live_server(*args) as running:
        yield running


def client_of(server: LiveServer, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def jsonl(*lines: dict) -> bytes:
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def request_line(custom_id: str, body: dict, url: str = "/v1/images/generations") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def ended(client: openai.OpenAI, batch_id: str, timeout_s: float = 120) -> SdkBatch:
    return wait_until(
        lambda: b if (b := client.batches.retrieve(batch_id)).status in ENDED else None,
        timeout_s,
        f"batch {batch_id} ending",
    )


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).read().decode().splitlines()]


def test_the_sdk_runs_a_batch_each_line_as_sent_alone_and_a_bad_line_names_its_field(
    server: LiveServer,
) -> None:
    client = client_of(server)
    bodies = {f"circle-{i}": {"prompt": "a red circle", "seed": 40 + i, **FAST} for i in range(20)}
    lines = [request_line(custom_id, body) for custom_id, body in bodies.items()]
    lines.insert(7, request_line("bad", {"prompt": "a red circle", "num_inference_steps": "3"}))
    uploaded = client.files.create(file=("requests.jsonl", jsonl(*lines)), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.status) == ("batch", len(jsonl(*lines)), "processed")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/images/generations", completion_window="24h"
    )
    assert batch.status == "in_progress" and batch.request_counts.total == 21
    done = ended(client, batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (
        20,
        1,
    )
    assert done.completed_at is not None and done.finalizing_at is not None
    output = file_lines(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == list(bodies)  # the input's order, each once
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"] == line["id"]
        sent = dict(bodies[line["custom_id"]])
        alone = client.images.generate(prompt=sent.pop("prompt"), size=sent.pop("size"), extra_body=sent)
        assert response["body"]["data"][0]["b64_json"] == alone.data[0].b64_json  # bit-identical
        assert response["body"]["data"][0]["seed"] == bodies[line["custom_id"]]["seed"]
    (bad,) = file_lines(client, done.error_file_id)
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    error = bad["response"]["body"]["error"]
    assert error["param"] == "num_inference_steps" and error["message"].startswith("num_inference_steps:")
    assert done.id in [b.id for b in client.batches.list()]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_an_edit_line_equals_the_multipart_edit(server: LiveServer) -> None:
    client = client_of(server)
    image, mask = Image.new("RGB", (64, 64), "white"), Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    ImageDraw.Draw(image).ellipse((16, 16, 48, 48), fill="red")
    ImageDraw.Draw(mask).rectangle((0, 0, 31, 63), fill=(0, 0, 0, 0))  # the left half: repainted
    image_png, mask_png = png_bytes(image), png_bytes(mask)
    extra = {"seed": 3, "num_inference_steps": 4, "deterministic": True}
    body = {
        "prompt": "a blue circle",
        "images": [{"image_url": "data:image/png;base64," + base64.b64encode(image_png).decode()}],
        "mask": {"image_url": "data:image/png;base64," + base64.b64encode(mask_png).decode()},
        **extra,
    }
    uploaded = client.files.create(
        file=("edit.jsonl", jsonl(request_line("e", body, "/v1/images/edits"))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/images/edits", completion_window="24h"
    )
    (line,) = file_lines(client, ended(client, batch.id).output_file_id)
    alone = client.images.edit(
        image=("a.png", image_png), mask=("m.png", mask_png), prompt="a blue circle", extra_body=extra
    )
    assert line["response"]["body"]["data"][0]["b64_json"] == alone.data[0].b64_json


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_a_malformed_file_and_a_window_other_than_24h_are_refused_naming_them(server: LiveServer) -> None:
    client = client_of(server)
    good = request_line("a", {"prompt": "a red circle"})
    for bad, words in [
        ({"method": "POST", "url": "/v1/images/generations", "body": {}}, "line 2: custom_id"),
        ({**good, "custom_id": "b", "url": "/v1/chat/completions"}, "line 2: url must be one of"),
        (good, "line 2: custom_id 'a' is on line 1 too"),
    ]:
        with pytest.raises(openai.BadRequestError, match=words) as refused:
            client.files.create(file=("bad.jsonl", jsonl(good, bad)), purpose="batch")
        assert refused.value.body["param"] == "file"
    with pytest.raises(openai.BadRequestError, match="line 1: is not valid JSON"):
        client.files.create(file=("bad.jsonl", b"{not json\n"), purpose="batch")
    uploaded = client.files.create(file=("ok.jsonl", jsonl(good)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window: must be 24h") as refused:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/images/generations",
            completion_window="1h",  # type: ignore[arg-type]
        )
    assert refused.value.body["param"] == "completion_window"
    mixed = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/images/edits", completion_window="24h"
    )
    assert mixed.status == "failed" and mixed.errors.data[0].line == 1 and mixed.errors.data[0].param == "url"


def test_another_keys_batch_and_files_are_a_404(server: LiveServer) -> None:
    mine, theirs = client_of(server, KEYS[0]), client_of(server, KEYS[1])
    uploaded = mine.files.create(
        file=("a.jsonl", jsonl(request_line("a", {"prompt": "a red circle", **FAST}))), purpose="batch"
    )
    batch = mine.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/images/generations", completion_window="24h"
    )
    for call in (
        lambda: theirs.batches.retrieve(batch.id),
        lambda: theirs.batches.cancel(batch.id),
        lambda: theirs.files.retrieve(uploaded.id),
        lambda: theirs.files.content(uploaded.id),
        lambda: theirs.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/images/generations", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in theirs.batches.list()]
    assert uploaded.id not in [f.id for f in theirs.files.list()]
    assert ended(mine, batch.id).status == "completed"


def test_cancel_stops_queued_lines_and_keeps_what_completed(server: LiveServer) -> None:
    client = client_of(server)
    lines = [
        request_line(f"c{i}", {"prompt": "a red circle", "seed": i, **FAST, "num_inference_steps": 8})
        for i in range(30)
    ]
    uploaded = client.files.create(file=("many.jsonl", jsonl(*lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/images/generations", completion_window="24h"
    )
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 60, "two lines done")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = ended(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    output = file_lines(client, done.output_file_id)
    assert len(output) == done.request_counts.completed < 30  # one line at a time: most never started
    assert all(line["response"]["status_code"] == 200 for line in output)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def generate_lines(count: int, steps: int) -> dict[str, dict]:
    return {
        f"r{i}": {"prompt": "a red circle", "seed": 70 + i, **FAST, "num_inference_steps": steps}
        for i in range(count)
    }


def create(client: openai.OpenAI, bodies: dict[str, dict]) -> SdkBatch:
    lines = [request_line(custom_id, body) for custom_id, body in bodies.items()]
    uploaded = client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/images/generations", completion_window="24h"
    )


def test_a_batch_a_restart_cut_short_completes_after_it_each_line_once(tmp_path: Path) -> None:
    """A SIGTERM while the batch runs: its running line goes back to its batch; the next server on
    the store runs what is left, and the output holds every line once, each as sent alone."""
    store = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    args = ("--job-store", store, "--batch-rows-in-flight", "2", "--drain-timeout-s", "0.5")
    bodies = generate_lines(16, steps=8)
    with live_server(*args) as first:
        client = client_of(first)
        batch = create(client, bodies)
        wait_until(
            lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 60, "two lines done"
        )
    reader = open_batch_store(store, "diffshard-shapes")
    cut = reader.get_batch(batch.id)
    assert cut is not None and cut.status == "in_progress" and 2 <= cut.completed < 16
    reader.close_store()
    with live_server(*args) as second:
        client = client_of(second)
        done = ended(client, batch.id)
        output = file_lines(client, done.output_file_id)
        alone = {}
        for custom_id in ("r0", "r15"):  # one made before the restart, one after
            sent = dict(bodies[custom_id])
            made = client.images.generate(prompt=sent.pop("prompt"), size=sent.pop("size"), extra_body=sent)
            alone[custom_id] = made.data[0].b64_json
    assert done.status == "completed" and done.request_counts.completed == 16
    assert [line["custom_id"] for line in output] == list(bodies)  # each once, in order
    made = {line["custom_id"]: line["response"]["body"]["data"][0]["b64_json"] for line in output}
    assert all(made[custom_id] == image for custom_id, image in alone.items())


def test_lines_left_at_the_windows_end_expire(tmp_path: Path) -> None:
    """A 6 s window (DIFFSHARD_BATCH_WINDOW_S; room for the first line on a busy host): the first
    line completes, the second's slow step (`[[slow]]`: twice --step-timeout-s) outlasts the window,
    the third never starts: both are error lines with code batch_expired, and the batch is expired."""
    store = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    args = ("--job-store", store, "--batch-rows-in-flight", "2", "--batch-window-s", "6")
    slow = ("--inject-faults", "--step-timeout-s", "4")
    bodies = generate_lines(3, steps=4)
    bodies["r1"]["prompt"] = "a red circle [[slow]]"
    with live_server(*args, *slow) as running:
        client = client_of(running)
        done = ended(client, create(client, bodies).id)
        output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert done.status == "expired" and done.expired_at is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    assert [line["custom_id"] for line in output] == ["r0"]
    assert [(line["custom_id"], line["error"]["code"], line["response"]) for line in errors] == [
        ("r1", "batch_expired", None),
        ("r2", "batch_expired", None),
    ]


def test_a_batch_on_a_redis_store_runs_and_its_output_streams_from_it(tmp_path: Path) -> None:
    with redis_server(tmp_path) as redis, live_server("--job-store", redis.url) as running:
        client = client_of(running)
        bodies = generate_lines(2, steps=2)
        done = ended(client, create(client, bodies).id)
        output = file_lines(client, done.output_file_id)
        assert [f.id for f in client.files.list(purpose="batch_output")] == [done.output_file_id]
    assert done.status == "completed" and [line["custom_id"] for line in output] == list(bodies)


def test_two_replicas_share_a_batch_and_one_killed_leaves_its_lines_to_the_other(tmp_path: Path) -> None:
    """Replicas on one Redis take the batch's lines between them; one killed mid-batch (SIGKILL:
    no release) lets its held line lapse to the other (DIFFSHARD_BATCH_LEASE_S 2): every line once."""
    args = ("--batch-rows-in-flight", "2", "--batch-lease-s", "2")
    bodies = generate_lines(12, steps=8)
    with (
        redis_server(tmp_path) as redis,
        live_server("--job-store", redis.url, *args) as one,
        live_server("--job-store", redis.url, *args) as two,
    ):
        batch = create(client_of(one), bodies)
        survivor = client_of(two)
        wait_until(
            lambda: survivor.batches.retrieve(batch.id).request_counts.completed >= 2, 60, "two lines done"
        )
        one.process.kill()
        done = ended(survivor, batch.id)
        output = file_lines(survivor, done.output_file_id)
    assert done.status == "completed" and done.request_counts.completed == 12
    assert [line["custom_id"] for line in output] == list(bodies)


def test_a_batch_event_is_confirmed_once_the_batch_has_that_end(store: BatchStore) -> None:
    batch, lines = a_batch("a", 1)
    store.add_batch(batch, lines, per_owner=None)
    confirm = confirm_batch(store)
    assert confirm(event_for("batch.completed", batch.id, 0)) is None  # its move is still to come
    line = store.claim("w", 0, LEASE_S)
    assert line is not None and store.finish("w", line.key, b"made", failed=False)
    closing = store.take_close(batch.id, "w", 0, LEASE_S)
    assert closing is not None
    closing.status, closing.completed_at = "completed", 1
    assert store.close(closing, "w", [])
    assert confirm(event_for("batch.completed", batch.id, 1)) is True
    assert confirm(event_for("batch.cancelled", batch.id, 1)) is False
    assert confirm(event_for("batch.completed", "batch_gone", 1)) is False
