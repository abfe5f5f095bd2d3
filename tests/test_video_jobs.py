"""Video jobs that hold at real sizes (issue 49), on a tiny Wan folder served by uvicorn: a video
has a deadline of its own, not an image request's; a replica whose step loop cannot take work
leaves the shared queue to the others, and no job fails for that replica's state; the per-key
and store bounds hold under concurrent creates (SQLite and a real redis-server)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from server.errors import Draining, StepFailed
from server.serving.jobs import Job, leaving_outcome
from server.serving.limits import Limits
from server.serving.videos import VideoRunner, open_job_store
from server.serving.videostore import CANCELLED, JobStore, VideoJob, read_whole
from tests.support.live import LiveServer, free_port, live_server
from tests.support.redis_server import redis_server
from tests.support.waiting import wait_until

FAST = {"num_frames": 9, "seed": 3, "num_inference_steps": 3, "guidance_scale": 5.0, "size": "32x32"}
ENDED = ("completed", "failed")


@pytest.fixture(scope="module")
def wan_folder(tiny_folder) -> Path:
    return tiny_folder("wan2.1")


@pytest.fixture(params=["sqlite", "redis"])
def job_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JobStore]:
    """Model "m"'s store in a SQLite file of this test's, or in a real redis-server of its own."""
    with contextlib.ExitStack() as stack:
        if request.param == "redis":
            url = stack.enter_context(redis_server(tmp_path)).url
        else:
            url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
        yield open_job_store(url, "m", lease_s=30)


def queued(job_id: str, owner: str, created_at: int) -> VideoJob:
    """A queued job of model "m" (its request's fields are not read by the store)."""
    return VideoJob(job_id, owner, "m", "p", "32x32", "1", {}, created_at=created_at)


def completed_before(store: JobStore, job_id: str, owner: str, model: str, content: dict[str, bytes]) -> None:
    """A completed job in `store`, as an earlier runner left it: added, claimed, finished."""
    store.add(replace(queued(job_id, owner, 0), model=model))
    job = store.claim("earlier")
    assert job is not None and job.id == job_id
    size = sum(len(data) for data in content.values())
    done = replace(job, status="completed", progress=100, expires_at=2**40, bytes=size)
    assert store.finish(done, "earlier", content)


def ended(base: str, job: str) -> Callable[[], dict | None]:
    """A poll: the job's record once it completed or failed, else None."""
    return lambda: v if (v := httpx.get(f"{base}/v1/videos/{job}").json())["status"] in ENDED else None


def test_a_video_job_past_its_own_deadline_names_the_setting_to_raise() -> None:
    timeout_s, setting = Limits().deadline(video=True)
    assert (timeout_s, setting) == (3600.0, "DIFFSHARD_VIDEO_TIMEOUT_S")
    assert Limits(request_timeout_s=2).deadline(video=False) == (2, "DIFFSHARD_REQUEST_TIMEOUT_S")
    job = Job([], 2, timeout_s, timeout_setting=setting)
    assert "3600 s (DIFFSHARD_VIDEO_TIMEOUT_S)" in str(leaving_outcome(job))


def own_store(tmp_path: Path) -> tuple[str, str]:
    """A job store of this test's own (the default file is every server's of the same user)."""
    return "--job-store", f"sqlite:///{tmp_path / 'jobs.sqlite'}"


def test_a_video_taking_longer_than_an_image_may_completes(wan_folder: Path, tmp_path: Path) -> None:
    """`--request-timeout-s 1` bounds an image request; a video's own deadline (an hour by
    default) bounds a video job. `[[slow]]` makes its third step last 2 × `--step-timeout-s`."""
    flags = ("--request-timeout-s", "1", "--step-timeout-s", "2", "--inject-faults", *own_store(tmp_path))
    with live_server("--model", str(wan_folder), *flags) as server:
        started = time.monotonic()
        made = httpx.post(f"{server.url}/v1/videos", json={"prompt": "[[slow]] a red circle", **FAST})
        assert made.status_code == 200, made.text
        done = wait_until(ended(server.url, made.json()["id"]), 120, "the video job ending")
        assert done["status"] == "completed", done
        assert time.monotonic() - started > 4  # 4 × the image bound: its slow step alone


def test_a_replica_that_cannot_take_work_leaves_the_shared_queue_to_the_other(
    wan_folder: Path, tmp_path: Path
) -> None:
    """One replica's step loop is wedged (`[[hang]]` on an image; its /readyz says so): the videos
    queued on it are not taken by it, nor failed (before: it took each, and failed it once the
    loop was found stuck); a replica started afterwards runs them all."""
    store = ("--model", str(wan_folder), "--video-lease-s", "2")
    with redis_server(tmp_path) as redis:
        # one lane (--parallel off): a wedged one leaves no other lane of this replica to run on
        flags = (
            *store,
            "--job-store",
            redis.url,
            "--parallel",
            "off",
            "--inject-faults",
            "--step-timeout-s",
            "1",
            "--drain-timeout-s",
            "1",
        )
        with live_server(*flags) as sick:
            hang = {"prompt": "[[hang]] a cat", "size": "32x32", "num_inference_steps": 4}
            wedge = threading.Thread(
                target=lambda: httpx.post(f"{sick.url}/v1/images/generations", json=hang, timeout=60),
                daemon=True,
            )
            wedge.start()
            wait_until(lambda: httpx.get(f"{sick.url}/readyz").status_code == 503, 30, "the loop wedged")
            jobs = []
            for index in range(3):
                made = httpx.post(f"{sick.url}/v1/videos", json={"prompt": f"a red circle {index}", **FAST})
                assert made.status_code == 200, made.text
                jobs.append(made.json()["id"])
            # the sick replica's runner looks for work every second while this one starts
            with live_server(*store, "--job-store", redis.url) as well:
                outcomes = [wait_until(ended(well.url, job), 120, f"job {job} ending") for job in jobs]
                assert [o["status"] for o in outcomes] == ["completed"] * 3, outcomes
            wedge.join(timeout=30)


def test_concurrent_adds_never_pass_a_bound_together(job_store: JobStore) -> None:
    """Counted and added in one step (SQLite's write lock, a Redis script): 20 threads adding one
    owner's jobs under a bound of 2 add exactly 2; the store's bound holds the same way."""
    start = threading.Barrier(20)

    def add(index: int, owner: str, per_owner: int | None, total: int | None) -> str | None:
        start.wait(timeout=30)
        job = queued(f"video_{owner}_{index}", owner, index)
        return job_store.add(job, per_owner, total)

    with ThreadPoolExecutor(20) as pool:
        outcomes = list(pool.map(lambda i: add(i, "key", 2, None), range(20)))
    assert outcomes.count(None) == 2 and outcomes.count("owner") == 18
    with ThreadPoolExecutor(20) as pool:  # others' jobs: the store's bound of 5 (2 already in)
        outcomes = list(pool.map(lambda i: add(i, f"other{i}", None, 5), range(20)))
    assert outcomes.count(None) == 3 and outcomes.count("total") == 17
    assert job_store.unfinished() == 5 and job_store.unfinished("key") == 2


def test_twenty_concurrent_creates_of_one_key_queue_its_share(wan_folder: Path, tmp_path: Path) -> None:
    """`--max-queue-per-key 2`: 20 creates sent at once get 2 jobs and 18 answers of 429 (before:
    each counted the key's jobs before any was added, and all 20 could pass)."""
    flags = ("--max-queue-per-key", "2", "--inject-faults", "--step-timeout-s", "3", *own_store(tmp_path))
    with live_server("--model", str(wan_folder), *flags) as server:
        body = {"prompt": "[[slow]] a red circle", **FAST}  # each job runs past the burst
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda _: client.post(f"{server.url}/v1/videos", json=body), range(20)))
        codes = sorted(a.status_code for a in answers)
        assert codes == [200] * 2 + [429] * 18, codes
        assert "has 2 requests waiting" in next(a for a in answers if a.status_code == 429).text


def test_while_a_video_model_loads_its_jobs_answer_503_not_404(wan_folder: Path) -> None:
    """Pollers of a job that exists must try again while the model loads (before: 404 "this
    server's model makes images"); an image model answers 404 saying why."""
    from server.app import create_app
    from server.settings import Settings
    from tests.support.asgi import request

    loading = request(create_app(Settings(model=wan_folder)), "GET", "/v1/videos/video_0")
    assert loading.status_code == 503 and loading.json()["error"]["code"] == "loading"
    images = request(create_app(Settings()), "GET", "/v1/videos/video_0")
    assert images.status_code == 404 and "makes images" in images.json()["error"]["message"]


def test_a_store_url_is_shown_without_its_password() -> None:
    """In the log and in errors: before the host, or in the query (redis-py reads both)."""
    from server.serving.videostore import shown

    assert shown("redis://:s3cret@h:6379/0") == "redis://***@h:6379/0"
    assert "s3cret" not in shown("redis://h:6379/0?password=s3cret&socket_timeout=5")
    assert "socket_timeout=5" in shown("redis://h:6379/0?password=s3cret&socket_timeout=5")
    assert shown("sqlite:///tmp/jobs.sqlite") == "sqlite:///tmp/jobs.sqlite"


def test_claims_go_round_the_keys(job_store: JobStore) -> None:
    """One key's 8 queued videos, then another's 1: the other's is the second taken, not the
    ninth (before: the oldest of any key); then the first key's next, and so on by turns."""
    store = job_store
    jobs = [("flood", index) for index in range(8)] + [("lone", 8)]
    for owner, index in jobs:
        store.add(queued(f"video_{owner}_{index}", owner, index))
    taken = [job.id for _ in range(4) if (job := store.claim("w")) is not None]
    assert taken == ["video_flood_0", "video_lone_8", "video_flood_1", "video_flood_2"]
    store.add(queued("video_late_9", "late", 9))
    next_job = store.claim("w")
    assert next_job is not None and next_job.id == "video_late_9"  # a key with no turn yet goes next


def runs_of(server: LiveServer) -> float:
    """The video job runs a replica started (`diffshard_video_runs_total`)."""
    assert server.metrics_url is not None
    text = httpx.get(server.metrics_url).text
    return next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("diffshard_video_runs_total")
    )


def test_a_job_whose_encode_outlasts_its_lease_is_made_once(wan_folder: Path, tmp_path: Path) -> None:
    """`[[slow-encode]]` adds 8 s to the encode, past a 2 s lease: the lease is renewed while it
    encodes, so the other replica (recovering lapsed jobs every second) never takes it over
    (before: it did, and made the video a second time)."""
    with redis_server(tmp_path) as redis:
        flags = (
            "--model",
            str(wan_folder),
            "--job-store",
            redis.url,
            "--video-lease-s",
            "2",
            "--inject-faults",
        )
        with (
            live_server(*flags, "--metrics-port", str(free_port())) as one,
            live_server(*flags, "--metrics-port", str(free_port())) as two,
        ):
            made = httpx.post(f"{one.url}/v1/videos", json={"prompt": "[[slow-encode]] a red circle", **FAST})
            done = wait_until(ended(one.url, made.json()["id"]), 120, "the video job ending")
            assert done["status"] == "completed", done
            assert runs_of(one) + runs_of(two) == 1


def test_sigterm_while_a_video_encodes_waits_for_it(wan_folder: Path, tmp_path: Path) -> None:
    """A drain waits for an encode in progress (up to `--drain-timeout-s`): the video is kept,
    not thrown away with its finished frames."""
    url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    flags = ("--model", str(wan_folder), "--job-store", url, "--inject-faults", "--drain-timeout-s", "30")
    with live_server(*flags) as server:
        made = httpx.post(f"{server.url}/v1/videos", json={"prompt": "[[slow-encode]] a red circle", **FAST})
        job = made.json()["id"]
        # progress 99: every step done, the video being encoded (100 once it is stored)
        wait_until(
            lambda: httpx.get(f"{server.url}/v1/videos/{job}").json()["progress"] == 99, 60, "the encode"
        )
        server.process.terminate()
        assert server.process.wait(timeout=60) == 0
    store = open_job_store(url, wan_folder.name, lease_s=30)
    kept = store.get(job)
    assert kept is not None and kept.status == "completed", kept
    assert read_whole(store.content(job, "frames.zip"))


def test_a_video_over_the_byte_cap_fails_and_leaves_the_others(wan_folder: Path, tmp_path: Path) -> None:
    """`--video-store-bytes 2000`: a video whose content is larger fails naming the setting, and
    another key's finished job stays (before: the budget went negative and every finished job of
    every key was deleted to make room it could not make)."""
    url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    store = open_job_store(url, wan_folder.name, lease_s=30)
    completed_before(store, "video_theirs", "other-key", wan_folder.name, {"video.mp4": b"x" * 10})
    with live_server("--model", str(wan_folder), "--job-store", url, "--video-store-bytes", "2000") as server:
        made = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a red circle", **FAST})
        done = wait_until(ended(server.url, made.json()["id"]), 120, "the video job ending")
        assert done["status"] == "failed" and "DIFFSHARD_VIDEO_STORE_BYTES" in done["error"]["message"], done
        still = httpx.get(f"{server.url}/v1/videos/video_theirs")
        assert still.status_code == 200 and still.json()["status"] == "completed"


def test_a_lapsed_job_is_queued_again_while_the_runner_is_busy(wan_folder: Path, tmp_path: Path) -> None:
    """Recovery runs on a timer: a dead replica's job goes back to the queue within seconds while
    this replica runs a long job (before: only once a runner was idle, so never under load). It
    runs one job at a time: with room for another it would take the lapsed job at once."""
    with redis_server(tmp_path) as redis:
        flags = (
            "--job-store",
            redis.url,
            "--video-lease-s",
            "2",
            "--inject-faults",
            "--step-timeout-s",
            "6",
            "--max-running-videos",
            "1",
        )
        with live_server("--model", str(wan_folder), *flags) as server:
            long = httpx.post(f"{server.url}/v1/videos", json={"prompt": "[[slow]] a red circle", **FAST})
            status = f"{server.url}/v1/videos/{long.json()['id']}"
            wait_until(
                lambda: httpx.get(status).json()["status"] == "in_progress", 60, "the long job running"
            )
            dead = open_job_store(redis.url, wan_folder.name, lease_s=1)  # a replica that then dies
            dead.add(replace(queued("video_dead", "key", 0), model=wan_folder.name))
            assert (taken := dead.claim("dead-replica")) is not None and taken.id == "video_dead"
            wait_until(lambda: dead.get("video_dead").status == "queued", 15, "the lapsed job queued again")
            assert httpx.get(status).json()["status"] == "in_progress"


def test_content_the_store_refuses_fails_its_job_naming_the_limit(tmp_path: Path) -> None:
    """Redis at its `maxmemory` refuses a frames ZIP: `finish` says so (StoreRefused, naming the
    limit), leaves no half-written upload, and the job can be failed (before: a transient error,
    the job regenerated and refused again, forever)."""
    import redis as redis_py

    from server.errors import StoreRefused

    with redis_server(tmp_path) as server:
        client = redis_py.Redis.from_url(server.url)
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 4 * 2**20)
        store = open_job_store(server.url, "m", lease_s=30)
        store.add(queued("video_big", "key", 0))
        job = store.claim("w")
        assert job is not None
        done = replace(job, status="completed", bytes=16 * 2**20)
        with pytest.raises(StoreRefused, match="maxmemory"):
            store.finish(done, "w", {"frames.zip": b"\0" * 16 * 2**20})
        assert not client.keys("*upload*")
        failed = replace(job, status="failed", error={"code": "video_failed", "message": "too big"})
        assert store.finish(failed, "w", None) and store.get("video_big").status == "failed"


def peak_rss_growth(pid: int, work: Callable[[], None]) -> int:
    """How far `pid`'s peak resident memory rose above its resident memory while `work` ran
    (the peak reset first: /proc/PID/clear_refs)."""

    def status(field: str) -> int:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1]) * 1024

    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = status("VmRSS:")
    work()
    return status("VmHWM:") - before


def test_parallel_downloads_of_a_large_frames_zip_stream_from_redis(wan_folder: Path, tmp_path: Path) -> None:
    """8 downloads at once of a 56 MiB frames ZIP from a Redis-backed server: each gets every byte,
    and the server's peak memory grows by at most 64 MiB (before: each download read the file
    whole into memory, 8 × 56 MiB)."""
    import hashlib

    size = 56 * 2**20
    archive = os.urandom(size)
    with redis_server(tmp_path) as redis:
        store = open_job_store(redis.url, wan_folder.name, lease_s=30)
        completed_before(store, "video_large", "", wan_folder.name, {"frames.zip": archive})
        del archive  # the test's copy: only its digest is kept
        digest = hashlib.sha256(read_whole(store.content("video_large", "frames.zip"))).hexdigest()
        with live_server("--model", str(wan_folder), "--job-store", redis.url) as server:
            url = f"{server.url}/v1/videos/video_large/content"

            def download(_: int) -> tuple[int, str]:
                seen, got = hashlib.sha256(), 0
                with httpx.stream("GET", url, params={"variant": "frames"}, timeout=120) as response:
                    assert response.status_code == 200 and response.headers["content-length"] == str(size)
                    for piece in response.iter_bytes():
                        seen.update(piece)
                        got += len(piece)
                return got, seen.hexdigest()

            got: list[tuple[int, str]] = []
            grew = peak_rss_growth(
                server.process.pid, lambda: got.extend(ThreadPoolExecutor(8).map(download, range(8)))
            )
        assert got == [(size, digest)] * 8
        print(f"8 downloads of {size / 2**20:.0f} MiB: the server's peak RSS grew {grew / 2**20:.1f} MiB")
        assert grew <= 64 * 2**20, f"the server's peak memory grew {grew / 2**20:.0f} MiB"


def test_a_lease_survives_a_missed_renewal_and_is_given_up_after_a_whole_lease() -> None:
    """A renewal the store does not answer (a blip) is tried again at the next beat; the lease
    is given up only when none has landed for a whole lease (before: at the first miss). The store
    is faked here, at its boundary: a real one cannot be made to miss one call on cue."""
    from server.errors import StoreUnavailable
    from server.serving.videolease import Lease

    class Flaky:
        def __init__(self) -> None:
            self.answers: list[bool | None] = []  # None: it does not answer

        def progress(self, job: VideoJob, worker: str) -> bool:
            answer = self.answers.pop(0)
            if answer is None:
                raise StoreUnavailable()
            return answer

    now = [0.0]
    store = Flaky()
    lease = Lease(store, queued("video_0", "key", 0), "w", lease_s=30, clock=lambda: now[0])  # type: ignore[arg-type]
    store.answers = [True, None, None, True]
    for at in (10, 20, 30, 40):  # two misses, 10 s apart, within the 30 s lease
        now[0] = at
        assert lease.renew()
    store.answers = [None, None, None, None]
    for at in (50, 60):
        now[0] = at
        assert lease.renew()
    now[0] = 70  # 30 s since the last landed
    with pytest.raises(StoreUnavailable):
        lease.renew()
    store.answers = [False]  # another runner holds it
    assert not Lease(store, queued("video_0", "key", 0), "w", 30).renew()  # type: ignore[arg-type]


def test_progress_streams_of_a_hung_store_leave_image_responses_their_threads(
    wan_folder: Path, tmp_path: Path
) -> None:
    """Redis stops answering (SIGSTOP: each call waits for its 10 s socket timeout) under 8
    progress streams: their polls wait on the store's own threads, and an image is answered
    while they all still wait (before: the polls held the default executor's threads, which also
    encode image responses, and the image waited for the first poll to time out)."""
    with (
        redis_server(tmp_path) as redis,
        live_server("--model", str(wan_folder), "--job-store", redis.url) as server,
    ):
        long = {**FAST, "num_inference_steps": 40, "num_frames": 17, "size": "64x64"}
        job = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a red circle", **long}).json()["id"]
        ended_streams: list[int] = []
        opened = threading.Barrier(9)

        def watch(index: int) -> None:
            url = f"{server.url}/v1/videos/{job}/events"
            with contextlib.suppress(httpx.HTTPError), httpx.stream("GET", url, timeout=120) as events:
                opened.wait(timeout=30)  # a stream cut short (suppressed) ends too
                for _ in events.iter_lines():
                    pass
            ended_streams.append(index)

        watchers = [threading.Thread(target=watch, args=(i,), daemon=True) for i in range(8)]
        for thread in watchers:
            thread.start()
        opened.wait(timeout=30)
        redis.process.send_signal(signal.SIGSTOP)
        try:
            image = httpx.post(
                f"{server.url}/v1/images/generations",
                json={"prompt": "a cat", "size": "32x32", "num_inference_steps": 2},
                timeout=120,
            )
            assert image.status_code == 200
            assert ended_streams == [], "a progress stream ended before the image was answered"
        finally:
            redis.process.send_signal(signal.SIGCONT)


def test_one_server_runs_a_models_jobs_in_a_sqlite_file(tmp_path: Path) -> None:
    """A second runner of the same model on the same file is refused at start, naming the fix
    (before: the default path was every server's, and each queued again and tidied the other's
    jobs); another model's runner shares the file and sees only its own jobs; a reader (a tool,
    a test) takes no lock."""
    from server.errors import ConfigError

    url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    first = open_job_store(url, "m", 30, runs=True)
    with pytest.raises(ConfigError, match="another server runs m's video jobs"):
        open_job_store(url, "m", 30, runs=True)
    other = open_job_store(url, "other", 30, runs=True)
    first.add(queued("video_m", "key", 0))
    reader = open_job_store(url, "m", 30)
    assert reader.get("video_m") is not None
    assert other.claim("w") is None and other.unfinished() == 0 and first.unfinished() == 1
    for store in (reader, other, first):
        store.close()
    open_job_store(url, "m", 30, runs=True).close()  # free again once the first is closed


class SteppedJobs:
    """A stand-in for the service: each video submitted is held until the test ends it, and the
    most held at once is counted."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, Future] = {}
        self.most = 0

    def submit(self, requests: list, request_id: str, **_: object) -> SimpleNamespace:
        future: Future = Future()
        with self.lock:
            self.held[request_id] = future
            self.most = max(self.most, sum(not f.done() for f in self.held.values()))
        return SimpleNamespace(future=future, progress=lambda: [(0, 3)], cancel=lambda: None)

    def running(self) -> set[str]:
        with self.lock:
            return {job for job, future in self.held.items() if not future.done()}

    def end(self, job: str, frames: np.ndarray | None = None, error: Exception | None = None) -> None:
        with self.lock:
            future = self.held[job]
        if error is None:
            future.set_result([frames])
        else:
            future.set_exception(error)


def test_the_runner_runs_its_bound_at_once_each_job_on_its_own(tmp_path: Path) -> None:
    """Two at once (`max_running`): a third is taken only as one ends; a job that fails leaves the
    others running; the metrics count every run and made second; a stop gives back what runs."""
    store = open_job_store(f"sqlite:///{tmp_path / 'jobs.sqlite'}", "m", lease_s=30, runs=True)
    service = SteppedJobs()
    runner = VideoRunner(
        store,
        service,
        fps=16,
        expiry_s=60,
        max_bytes=2**30,
        lease_s=30,
        takes_work=lambda: True,
        max_running=2,
    )
    frames = np.full((1, 16, 16, 3), 0.5, dtype=np.float32)
    try:
        for index in range(4):
            runner.add(replace(queued(f"video_{index}", "key", index), request={"prompt": "p"}))
        wait_until(lambda: len(service.running()) == 2, 30, "two running")
        assert service.running() == {"video_0", "video_1"} and store.counts()["queued"] == 2
        service.end("video_0", error=StepFailed("a step failed for it"))  # its slot goes to the next
        wait_until(lambda: service.running() == {"video_1", "video_2"}, 30, "the third running")
        for job in ("video_1", "video_2"):
            service.end(job, frames)
        wait_until(lambda: service.running() == {"video_3"}, 30, "the last running")
        service.end("video_3", frames)
        wait_until(lambda: store.counts()["completed"] == 3, 30, "three made")
        assert store.get("video_0").status == "failed" and service.most == 2
        assert runner.figures()["video_runs"] == 4 and runner.figures()["video_seconds"] == 3.0
        for index in (4, 5):
            runner.add(replace(queued(f"video_{index}", "key", index), request={"prompt": "p"}))
        wait_until(lambda: len(service.running()) == 2, 30, "two more running")
        runner.stop()
        for job in ("video_4", "video_5"):  # the service closing answers its jobs so
            service.end(job, error=Draining("the server is shutting down"))
        runner.join(10)
        assert [store.get(f"video_{i}").status for i in (4, 5)] == ["queued", "queued"]
    finally:
        runner.stop()
        runner.join(10)
        store.close()


def test_a_cancelled_job_ends_failed_and_nothing_runs_it_after(job_store: JobStore) -> None:
    """Cancelled queued, it is out of the queue; cancelled running, its runner's renewal, release
    and finish are all refused (another replica's cancel needs nothing of it), and recovery does
    not queue it again; a finished job is answered as it is."""
    for index in range(2):
        job_store.add(queued(f"video_{index}", "key", index))
    running = job_store.claim("runner")
    assert running is not None and running.id == "video_0"
    cancelled = job_store.cancel("video_1", 500)
    assert cancelled is not None and (cancelled.status, cancelled.error) == ("failed", CANCELLED)
    assert cancelled.expires_at == 500 and job_store.claim("another") is None  # it never starts
    assert job_store.cancel("video_0", 600).status == "failed"
    assert not job_store.progress(running, "runner")
    done = replace(running, status="completed", progress=100, expires_at=2**40, bytes=3)
    assert not job_store.finish(done, "runner", {"video.mp4": b"mp4"})
    assert not job_store.release(replace(running), "runner") and job_store.recover() == 0
    now = job_store.get("video_0")
    assert (now.status, now.error, now.expires_at) == ("failed", CANCELLED, 600)
    assert job_store.content("video_0", "video.mp4") is None and job_store.claim("another") is None
    assert job_store.unfinished() == 0 and job_store.counts()["failed"] == 2
    assert job_store.cancel("video_0", 700).expires_at == 600 and job_store.cancel("video_9", 0) is None


def steps_and_progress(url: str) -> tuple[int, dict]:
    """The replica's steps in all and its running jobs' progress, read together."""
    engine = httpx.get(f"{url}/v1/stats").json()["engine"]
    return engine["steps"], engine["progress"]


def test_a_video_cancelled_on_another_replica_leaves_its_batch_within_a_step(
    wan_folder: Path, tmp_path: Path
) -> None:
    """Replica a runs a long job; replica b, sharing the Redis store, is asked to cancel it: a
    drops it at the end of the step in flight (told on the store's channel), it ends
    failed/cancelled and no replica runs it again; a job queued behind it never starts once
    cancelled, and another key's job then takes a's rows and completes."""
    # ~0.1 s a step (the cancel's path is a few milliseconds), long enough for b to start meanwhile
    long = {**FAST, "size": "256x256", "num_frames": 33, "num_inference_steps": 1000}
    with redis_server(tmp_path) as redis:
        flags = ("--model", str(wan_folder), "--job-store", redis.url, "--max-running-videos", "1")
        flags += ("--max-steps", "1000")
        with live_server(*flags) as a:
            first = httpx.post(f"{a.url}/v1/videos", json={"prompt": "a red circle", **long}).json()["id"]
            queued_behind = httpx.post(f"{a.url}/v1/videos", json={"prompt": "a cat", **FAST}).json()["id"]
            wait_until(lambda: first in steps_and_progress(a.url)[1], 60, "the long job running on a")
            gone = httpx.post(f"{a.url}/v1/videos/{queued_behind}/cancel").json()
            assert (gone["status"], gone["error"]["code"]) == ("failed", "cancelled")
            with live_server(*flags) as b:  # takes nothing yet: a's one job holds a, b's queue is empty
                at, progress = steps_and_progress(a.url)
                assert first in progress, "the long job ended before its cancel: make it longer"
                answer = httpx.delete(f"{b.url}/v1/videos/{first}")
                assert answer.json() == {"id": first, "object": "video.deleted", "deleted": False}
                wait_until(lambda: first not in steps_and_progress(a.url)[1], 30, "a dropping the job")
                # the step in flight at the read above, and the one in flight as the cancel lands
                assert steps_and_progress(a.url)[0] - at <= 2
                after = httpx.post(f"{b.url}/v1/videos", json={"prompt": "a dog", **FAST}).json()["id"]
                assert wait_until(ended(a.url, after), 60, "another job made")["status"] == "completed"
                for job in (first, queued_behind):
                    record = httpx.get(f"{b.url}/v1/videos/{job}").json()
                    assert (record["status"], record["error"]["code"]) == ("failed", "cancelled"), record
                    assert httpx.delete(f"{b.url}/v1/videos/{job}").json()["deleted"] is True
