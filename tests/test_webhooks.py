"""Webhooks (issue 73): events from a durable outbox in the job store, signed as Standard Webhooks
so OpenAI's SDK accepts them, delivered at least once to a real HTTP receiver on loopback: tried
again with a backoff, bounded by a timeout and a read cap, confirmed against the store before
they go, shared by replicas on Redis under a lease; a finished video's `video.completed` reaches
the receiver across a restart while the receiver was down, once by its `webhook-id`."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from server.__main__ import _parser, _settings
from server.errors import ConfigError
from server.metrics import Metrics
from server.serving.outbox import Event, Outbox, event_for, open_outbox
from server.serving.stats import Snapshot
from server.serving.webhooks import READ_CAP, Webhooks, sign
from server.settings import Settings
from tests.support.live import LiveServer, free_port, live_server
from tests.support.redis_server import redis_server
from tests.support.waiting import wait_until

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
FAST = {"num_frames": 9, "seed": 3, "num_inference_steps": 3, "guidance_scale": 5.0, "size": "32x32"}
SDK = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")  # only its webhooks.unwrap is called


@dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]


class Receiver:
    """A webhook endpoint on loopback (http.server on threads of its own): records each POST and
    answers the statuses in `answers` first, then 200. `how`: "slow" holds its answer until
    released; "huge" answers 200 with an endless body; "trickle" one byte at a time."""

    def __init__(self, how: str = "ok") -> None:
        self.port, self.how = free_port(), how
        self.got: list[Delivery] = []
        self.answers: list[int] = []
        self.sent = 0  # bytes of a "huge" body that got out
        self.released = threading.Event()
        self._changed = threading.Condition()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/diffshard?token=path-secret"

    def up(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with receiver._changed:
                    receiver.got.append(Delivery({k.lower(): v for k, v in self.headers.items()}, body))
                    status = receiver.answers.pop(0) if receiver.answers else 200
                    receiver._changed.notify_all()
                if receiver.how == "slow":
                    receiver.released.wait(30)
                self.send_response(status)
                self.send_header("content-length", str(2**30 if receiver.how != "ok" else 2))
                self.end_headers()
                with contextlib.suppress(OSError):
                    if receiver.how == "ok":
                        self.wfile.write(b"ok")
                    while receiver.how == "huge" and not receiver.released.is_set():
                        self.wfile.write(bytes(READ_CAP))
                        receiver.sent += READ_CAP
                    while receiver.how == "trickle" and not receiver.released.wait(0.05):
                        self.wfile.write(b"x")
                        self.wfile.flush()

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def down(self) -> None:
        self.released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def wait_for(self, condition: Callable[[list[Delivery]], bool], timeout_s: float = 30) -> list[Delivery]:
        with self._changed:
            assert self._changed.wait_for(lambda: condition(self.got), timeout_s), f"got {self.got}"
            return list(self.got)


@contextlib.contextmanager
def receiving(how: str = "ok") -> Iterator[Receiver]:
    receiver = Receiver(how)
    receiver.up()
    try:
        yield receiver
    finally:
        receiver.down()


@pytest.fixture(params=["sqlite", "redis"])
def outbox_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A job store of this test's: a SQLite file, or a real redis-server of its own."""
    if request.param == "redis":
        with redis_server(tmp_path) as redis:
            yield redis.url
    else:
        yield f"sqlite:///{tmp_path / 'jobs.sqlite'}"


@contextlib.contextmanager
def delivering(outbox: Outbox, *urls: str, confirm: Callable[[Event], bool | None] = lambda _: True, **kw):
    """A started deliverer (quick retries), stopped at the end."""
    settings = {"first_retry_s": 0.05, "retry_for_s": 60, "timeout_s": 2} | kw
    hooks = Webhooks(outbox, urls, SECRET, **settings)
    hooks.confirms["video."] = confirm
    hooks.start()
    try:
        yield hooks
    finally:
        hooks.stop()
        hooks.join(10)


def unwrapped(delivery: Delivery) -> object:
    return SDK.webhooks.unwrap(delivery.body, delivery.headers, secret=SECRET)


def test_a_delivered_event_is_what_openais_sdk_unwraps_and_a_tampered_one_is_refused(tmp_path: Path) -> None:
    outbox = open_outbox(f"sqlite:///{tmp_path / 'jobs.sqlite'}", "m")
    with receiving() as receiver, delivering(outbox, receiver.url) as hooks:
        hooks.notify("video.completed", "video_abc")
        (delivery,) = receiver.wait_for(lambda got: len(got) == 1)
        wait_until(lambda: hooks.figures().events["delivered"] == 1, 10, "the event ended delivered")
        event = unwrapped(delivery)
        assert (event.type, event.data.id, event.object) == ("video.completed", "video_abc", "event")
        assert event.id == delivery.id == event_for("video.completed", "video_abc", 0).id
        assert abs(int(delivery.headers["webhook-timestamp"]) - time.time()) < 60  # signed when sent
        with pytest.raises(openai.InvalidWebhookSignatureError):
            SDK.webhooks.unwrap(
                delivery.body.replace(b"video_abc", b"video_xyz"), delivery.headers, secret=SECRET
            )
        # the figures the metrics read at scrape time
        registry = CollectorRegistry()
        Metrics(registry, lambda: Snapshot("m", "float32", 1), webhooks=hooks.figures)
        value = registry.get_sample_value
        assert value("diffshard_webhook_requests_total", {"result": "acknowledged"}) == 1
        assert value("diffshard_webhook_requests_total", {"result": "failed"}) == 0
        assert value("diffshard_webhook_events_total", {"outcome": "delivered"}) == 1
        assert value("diffshard_webhook_pending_events") == 0 and value("diffshard_webhook_lag_seconds") == 0


def test_the_same_move_makes_the_same_event_and_the_outbox_keeps_it_once(outbox_url: str) -> None:
    outbox = open_outbox(outbox_url, "m")
    first, again = event_for("video.completed", "video_1", 100), event_for("video.completed", "video_1", 200)
    assert first.id == again.id and first.id.startswith("evt_")
    assert event_for("video.failed", "video_1", 100).id != first.id
    outbox.add(first)
    outbox.add(again)  # a job run again after a crash announces its move again
    assert outbox.backlog() == (1, 100)
    assert open_outbox(outbox_url, "other").backlog() == (0, None)  # a model's own events only
    taken = outbox.take("me", time.time(), 30)
    assert taken is not None and taken.event == first and outbox.take("you", time.time(), 30) is None
    assert outbox.end(first.id, "me", "delivered", time.time())
    outbox.add(first)  # ended: kept a while, so adding it again adds nothing
    assert outbox.backlog() == (0, None)


def test_an_endpoint_answering_500_is_tried_again_and_one_that_acknowledged_is_not(tmp_path: Path) -> None:
    outbox = open_outbox(f"sqlite:///{tmp_path / 'jobs.sqlite'}", "m")
    with receiving() as failing, receiving() as fine:
        failing.answers = [500, 503]
        with delivering(outbox, failing.url, fine.url) as hooks:
            hooks.notify("video.failed", "video_1")
            tries = failing.wait_for(lambda got: len(got) == 3)
            wait_until(lambda: hooks.figures().events["delivered"] == 1, 10, "the event ended delivered")
            assert len(fine.got) == 1  # acknowledged once: kept in the outbox, not sent again
            assert len({t.id for t in tries}) == 1 and all(unwrapped(t) for t in tries)
            assert hooks.figures().posts == {"acknowledged": 2, "failed": 2}


def test_a_slow_answer_times_out_and_a_huge_or_trickling_one_is_read_only_so_far(tmp_path: Path) -> None:
    """Three endpoints: one never answers (the timeout ends it: failed), one answers 200 with a
    body of a GiB, one 200 a byte every 50 ms: each acknowledged after READ_CAP bytes or the timeout."""
    outbox = open_outbox(f"sqlite:///{tmp_path / 'jobs.sqlite'}", "m")
    with (
        receiving("slow") as slow,
        receiving("huge") as huge,
        receiving("trickle") as trickle,
        delivering(outbox, slow.url, huge.url, trickle.url, timeout_s=0.5, first_retry_s=30) as hooks,
    ):
        started = time.monotonic()
        hooks.notify("video.completed", "video_1")
        wait_until(lambda: sum(hooks.figures().posts.values()) == 3, 10, "a POST to each")
        assert time.monotonic() - started < 4  # ~0.5 s each
        figures = hooks.figures()
        assert figures.posts == {"acknowledged": 2, "failed": 1}
        assert huge.sent < 2**26  # what the socket buffers took of 1 GiB, not more
        assert figures.pending == 1  # the slow endpoint's POST comes due again later


def test_an_event_waits_while_its_move_is_in_flight_and_is_dropped_if_it_never_happens(
    tmp_path: Path,
) -> None:
    verdicts: dict[str, bool | None] = {"video_running": None, "video_gone": False}
    asked: Counter = Counter()

    def confirm(event: Event) -> bool | None:
        asked[event.subject] += 1
        return verdicts[event.subject]

    outbox = open_outbox(f"sqlite:///{tmp_path / 'jobs.sqlite'}", "m")
    with receiving() as receiver, delivering(outbox, receiver.url, confirm=confirm) as hooks:
        hooks.notify("video.completed", "video_running")
        hooks.notify("video.completed", "video_gone")
        wait_until(lambda: asked["video_running"] >= 3, 10, "the running job asked about again")
        assert receiver.got == [] and hooks.figures().events["unconfirmed"] == 1 and asked["video_gone"] == 1
        verdicts["video_running"] = True  # its job's end is stored now
        (delivery,) = receiver.wait_for(lambda got: len(got) == 1)
        assert unwrapped(delivery).data.id == "video_running"


def test_an_event_not_delivered_within_the_bound_is_dropped_as_expired(outbox_url: str) -> None:
    outbox = open_outbox(outbox_url, "m")
    down = Receiver()  # never up: its port refuses
    outbox.add(event_for("video.completed", "video_1", int(time.time()) - 31))
    with delivering(outbox, down.url, retry_for_s=30) as hooks:
        wait_until(lambda: hooks.figures().events["expired"] == 1, 10, "the event expired")
        assert hooks.figures().posts == {"acknowledged": 0, "failed": 1} and outbox.backlog() == (0, None)


def test_an_outbox_shared_by_two_deliverers_delivers_each_event_once_and_a_lapsed_lease_elsewhere(
    outbox_url: str,
) -> None:
    """Twenty events, two deliverers on one outbox (replicas on Redis): each event is sent once.
    Then one taken by a holder that died mid-delivery is sent once its lease has lapsed."""
    with receiving() as receiver:
        outbox = open_outbox(outbox_url, "m")
        lost = event_for("video.failed", "video_lost", int(time.time()) - 1)  # due first
        outbox.add(lost)
        held = outbox.take("died", time.time(), 1.0)
        assert held is not None and held.event == lost
        lapses = time.monotonic() + 1.0
        for index in range(20):
            outbox.add(event_for("video.completed", f"video_{index}", int(time.time())))
        with (
            delivering(open_outbox(outbox_url, "m"), receiver.url) as one,
            delivering(open_outbox(outbox_url, "m"), receiver.url) as other,
        ):
            got = receiver.wait_for(lambda got: lost.id in {d.id for d in got} and len(got) >= 21)
            assert time.monotonic() >= lapses - 0.1  # not before its lease lapsed
            assert sorted(Counter(d.id for d in got).values()) == [1] * 21, "an event sent twice"

            def delivered() -> bool:
                return sum(hooks.figures().events["delivered"] for hooks in (one, other)) == 21

            wait_until(delivered, 10, "every event ended delivered")


def test_the_secret_never_shows_in_logs_errors_or_help(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    shown = [SECRET, SECRET.removeprefix("whsec_")]
    outbox = open_outbox(f"sqlite:///{tmp_path / 'jobs.sqlite'}", "m")
    with receiving() as receiver, delivering(outbox, receiver.url) as hooks:
        receiver.answers = [500]
        hooks.notify("video.completed", "video_1")
        receiver.wait_for(lambda got: len(got) == 2)
    assert "webhook" in caplog.text and "path-secret" not in caplog.text  # the URL's origin only
    problems: list[str] = []
    for env in (
        {"DIFFSHARD_WEBHOOK_SECRET": SECRET[:-1]},  # malformed: cut short
        {"DIFFSHARD_WEBHOOK_SECRET": SECRET, "DIFFSHARD_WEBHOOK_SECRET_FILE": str(tmp_path / "none")},
    ):
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            with pytest.raises(ValidationError) as refused:
                Settings(devices="cpu", webhook=["http://127.0.0.1:9/"])
            problems.append(str(refused.value))
            with pytest.raises(ConfigError) as refused_cli:
                _settings(_parser().parse_args(["serve", "--webhook", "http://127.0.0.1:9/"]))
            problems.append(str(refused_cli.value))
    assert "DIFFSHARD_WEBHOOK_SECRET" in problems[0] and "not base64" in problems[1]
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    assert "--webhook-secret-file" in capsys.readouterr().out  # and no --webhook-secret flag
    # no such flag: argparse takes it for --webhook-secret-file, which does not show what it names
    with pytest.raises(ConfigError, match="names a secret, not a file") as refused_cli:
        _settings(
            _parser().parse_args(["serve", "--webhook", "http://127.0.0.1:9/", "--webhook-secret", SECRET])
        )
    problems.append(str(refused_cli.value))
    for text in [caplog.text, *problems, capsys.readouterr().err]:
        assert not any(secret in text for secret in shown)


def test_webhook_settings_are_checked_at_startup_naming_the_setting(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    settings = Settings(devices="cpu", webhook=["https://hooks.example/x"], webhook_secret_file=secret_file)
    assert settings.webhook == ("https://hooks.example/x",)
    for given, says in [
        ({"webhook": ["https://hooks.example/x"]}, r"--webhook \(DIFFSHARD_WEBHOOK\) needs a secret"),
        ({"webhook": ["ftp://hooks.example/x"], "webhook_secret_file": secret_file}, "http:// or https://"),
        ({"webhook": ["https:///x"], "webhook_secret_file": secret_file}, "with a host"),
        ({"webhook_secret_file": tmp_path / "none"}, r"--webhook-secret-file .*: cannot read"),
        ({"webhook_secret": "whsec_" + base64.b64encode(b"short").decode()}, "holds 5 bytes"),
    ]:
        with pytest.raises(ValidationError, match=says):
            Settings(devices="cpu", **given)
    # signed with the time of the move (a retry hours later) the SDK would refuse it: signed as sent
    at = int(time.time()) - 400
    headers = {
        "webhook-id": "evt_1",
        "webhook-timestamp": str(at),
        "webhook-signature": sign(SECRET, "evt_1", at, b"{}"),
    }
    with pytest.raises(openai.InvalidWebhookSignatureError, match="too old"):
        SDK.webhooks.unwrap(b"{}", headers, secret=SECRET)


def test_a_finished_batchs_event_reaches_the_receiver(tmp_path: Path) -> None:
    """The built-in model's Batch API: a batch of two lines completes, and `batch.completed`
    for it arrives signed (the batch runner's producer and its confirm, wired by the app)."""
    store = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    with (
        receiving() as receiver,
        live_server(
            "--job-store", store, "--webhook", receiver.url, env={"DIFFSHARD_WEBHOOK_SECRET": SECRET}
        ) as server,
    ):
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1")
        body = {"prompt": "a red circle", "num_inference_steps": 2, "size": "64x64"}
        lines = [
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/images/generations", "body": body}
            for i in (1, 2)
        ]
        uploaded = client.files.create(
            file=("requests.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()),
            purpose="batch",
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/images/generations", completion_window="24h"
        )
        (delivery,) = receiver.wait_for(lambda got: len(got) >= 1, 120)
        event = unwrapped(delivery)
        assert (event.type, event.data.id) == ("batch.completed", batch.id)
        assert client.batches.retrieve(batch.id).status == "completed"


# A tiny Wan model served for real: a finished video's `video.completed` and a restart.


@pytest.fixture(scope="module")
def wan_folder(tiny_folder) -> Path:
    return tiny_folder("wan2.1")


def posts(server: LiveServer, result: str) -> float:
    text = httpx.get(server.metrics_url, timeout=10).text
    found = re.search(rf'^diffshard_webhook_requests_total{{result="{result}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def made(server: LiveServer) -> str:
    """A video job made to the end; its id."""
    job = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a red circle", **FAST}, timeout=30)
    assert job.status_code == 200, job.text

    def ended() -> dict | None:
        video = httpx.get(f"{server.url}/v1/videos/{job.json()['id']}").json()
        return video if video["status"] in ("completed", "failed") else None

    done = wait_until(ended, 120, "the video job ending")
    assert done["status"] == "completed", done
    return done["id"]


def restarted_while_down(wan_folder: Path, tmp_path: Path, down_s: float) -> None:
    """The receiver down while a video completes, its server stopped and started again on the
    same store; then up, down `down_s` at least: the event arrives, once by its webhook-id."""
    receiver = Receiver()  # not up yet: its port refuses
    went_down = time.monotonic()
    store = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    args = (
        "--model",
        str(wan_folder),
        "--job-store",
        store,
        "--webhook",
        receiver.url,
        "--webhook-retry-s",
        "0.5",
    )
    env = {"DIFFSHARD_WEBHOOK_SECRET": SECRET}
    with live_server(*args, "--metrics-port", str(free_port()), env=env) as first:
        job = made(first)
        wait_until(lambda: posts(first, "failed") >= 1, 30, "a POST to the receiver, down, failed")
    assert not any(SECRET.removeprefix("whsec_") in line for line in first.log)
    with live_server(*args, "--metrics-port", str(free_port()), env=env) as second:
        wait_until(lambda: posts(second, "failed") >= 1, 60, "tried again after the restart")
        wait_until(lambda: time.monotonic() - went_down >= down_s, down_s + 60, f"{down_s} s down")
        receiver.up()
        try:
            receiver.wait_for(lambda got: any(unwrapped(d).data.id == job for d in got), 90)
            later = made(second)  # the receiver up: a new job's event arrives as it ends
            got = receiver.wait_for(lambda got: any(unwrapped(d).data.id == later for d in got), 30)
        finally:
            receiver.down()
    events = {d.id: unwrapped(d) for d in got}  # duplicates on the wire are one event by its id
    assert sorted((e.type, e.data.id) for e in events.values()) == sorted(
        [("video.completed", job), ("video.completed", later)]
    )
    job_ids = [d.id for d in got if unwrapped(d).data.id == job]
    assert len(set(job_ids)) == 1


def test_a_finished_videos_event_arrives_once_across_a_restart_while_the_receiver_was_down(
    wan_folder: Path, tmp_path: Path
) -> None:
    restarted_while_down(wan_folder, tmp_path, down_s=0)


@pytest.mark.slow
def test_the_receiver_down_for_30_s_across_a_restart_still_gets_the_event_once(
    wan_folder: Path, tmp_path: Path
) -> None:
    restarted_while_down(wan_folder, tmp_path, down_s=30)
