"""Video jobs that hold at real sizes (issue 49), on a tiny Wan folder served by uvicorn: a video
has a deadline of its own, not an image request's; a replica whose step loop cannot take work
leaves the shared queue to the others, and no job fails for that replica's state; the per-key
and store bounds hold under concurrent creates (SQLite and a real redis-server)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server.serving.jobs import Job, leaving_outcome
from server.serving.limits import Limits
from server.serving.videos import open_job_store
from server.serving.videostore import JobStore, VideoJob
from tests.live import live_server
from tests.redis_server import redis_server
from tests.tiny_pipelines import build_wan_folder
from tests.waiting import wait_until

FAST = {"num_frames": 9, "seed": 3, "num_inference_steps": 3, "guidance_scale": 5.0, "size": "32x32"}
ENDED = ("completed", "failed")


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wan_folder(tmp_path_factory.mktemp("wan") / "tiny-wan")


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
    """`--request-timeout-s 2` bounds an image request; a video's own deadline (an hour by
    default) bounds a video job. `[[slow]]` makes its third step last 2 × `--step-timeout-s`."""
    flags = ("--request-timeout-s", "2", "--step-timeout-s", "6", "--inject-faults", *own_store(tmp_path))
    with live_server("--model", str(wan_folder), *flags) as server:
        started = time.monotonic()
        made = httpx.post(f"{server.url}/v1/videos", json={"prompt": "[[slow]] a red circle", **FAST})
        assert made.status_code == 200, made.text
        done = wait_until(ended(server.url, made.json()["id"]), 120, "the video job ending")
        assert done["status"] == "completed", done
        assert time.monotonic() - started > 10


def test_a_replica_that_cannot_take_work_leaves_the_shared_queue_to_the_other(
    wan_folder: Path, tmp_path: Path
) -> None:
    """One replica's step loop is wedged (`[[hang]]` on an image; its /readyz says so): the videos
    queued on it are not taken by it, nor failed (before: it took each, and failed it once the
    loop was found stuck); a replica started afterwards runs them all."""
    store = ("--model", str(wan_folder), "--video-lease-s", "2")
    with redis_server(tmp_path) as redis:
        # one lane (--parallel off): a wedged one leaves no other lane of this replica to run on
        flags = (*store, "--job-store", redis.url, "--parallel", "off", "--inject-faults",
                 "--step-timeout-s", "1", "--drain-timeout-s", "1")  # fmt: skip
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
    flags = ("--max-queue-per-key", "2", "--inject-faults", "--step-timeout-s", "5", *own_store(tmp_path))
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
    from server.config import Settings
    from tests.test_app import request

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
