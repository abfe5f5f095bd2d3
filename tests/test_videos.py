"""/v1/videos over real HTTP (issue 41): a tiny Wan folder served by uvicorn, driven by OpenAI's
SDK. A job's frames equal WanPipeline's within 2/255, its MP4 has every frame and decodes close
to them, its thumbnail is the first frame; a job a SIGTERM cut short completes after a restart
on the same job store, without being sent again, and a completed one's content survives another
restart; two replicas sharing a real redis-server answer each other's jobs, and one finishes the
job of the other when it is killed; bad input gets a 4xx naming the problem."""

from __future__ import annotations

import io
import signal
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from server.requests import GenerationRequest
from tests.support.live import free_port, live_server, sse
from tests.support.lora import random_wan_lora
from tests.support.redis_server import redis_server
from tests.support.tiny_wan22 import wan_video
from tests.support.waiting import wait_until

# openai 3.x warns on every videos call that OpenAI's own (Sora) service is scheduled to close
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
FAST = {"num_frames": 9, "seed": 3, "num_inference_steps": 3, "guidance_scale": 5.0}


@pytest.fixture(scope="module")
def wan_folder(tiny_folder) -> Path:
    return tiny_folder("wan2.1")


def frames_of(archive: bytes) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return np.stack([np.asarray(Image.open(io.BytesIO(z.read(n)))) for n in sorted(z.namelist())])


def test_a_video_job_over_the_sdk_equals_wan_pipeline_and_bad_input_gets_4xx(
    wan_folder: Path, tmp_path: Path
) -> None:
    store, keys = f"sqlite:///{tmp_path / 'jobs.sqlite'}", tmp_path / "keys"
    keys.write_text("sk-first\nsk-second\n")
    style = random_wan_lora(wan_folder, tmp_path / "style.safetensors", 1)
    args = (
        "--model",
        str(wan_folder),
        "--job-store",
        store,
        "--api-key-file",
        str(keys),
        "--max-queue-per-key",
        "1",
        "--drain-timeout-s",
        "0.5",
        "--lora",
        f"style={style}",
    )
    with live_server(*args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-first", max_retries=0)
        styled = client.videos.create_and_poll(
            prompt="a red circle",
            size="32x32",
            extra_body={**FAST, "lora": {"style": 0.8}},
            poll_interval_ms=50,
        )
        styled_frames = frames_of(client.videos.download_content(styled.id, variant="frames").read())
        client.videos.delete(styled.id)
        video = client.videos.create_and_poll(
            prompt="a red circle", size="32x32", extra_body=FAST, poll_interval_ms=50
        )
        assert (video.status, video.progress, video.size, video.seconds) == ("completed", 100, "32x32", "0.5")
        frames = frames_of(client.videos.download_content(video.id, variant="frames").read())
        mp4 = client.videos.download_content(video.id).read()
        thumbnail = client.videos.download_content(video.id, variant="thumbnail").read()
        sprites = client.videos.download_content(video.id, variant="spritesheet").read()
        listed = [v.id for v in client.videos.list()]
        longer = {}  # the published UniPC scheduler's history over more steps
        for steps in (6, 20):
            body = {**FAST, "num_inference_steps": steps}
            made = client.videos.create_and_poll(
                prompt="a red circle", size="32x32", poll_interval_ms=50, extra_body=body
            )
            longer[steps] = frames_of(client.videos.download_content(made.id, variant="frames").read())
            client.videos.delete(made.id)
        bad_input_gets_a_4xx_naming_the_problem(server.url, video.id)
    request = GenerationRequest(
        "a red circle", seed=3, steps=3, guidance_scale=5.0, width=32, height=32, frames=9
    )
    theirs = (wan_video(wan_folder, request) * 255).round().astype(int)
    assert frames.shape == theirs.shape == (9, 32, 32, 3)
    assert int(np.abs(frames.astype(int) - theirs).max()) <= 2
    for steps, made in longer.items():
        theirs_longer = (wan_video(wan_folder, replace(request, steps=steps)) * 255).round()
        assert int(np.abs(made.astype(int) - theirs_longer.astype(int)).max()) <= 2, steps
    with av.open(io.BytesIO(mp4)) as container:  # H.264 in yuv420p: lossy, chroma halved
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(int)
    assert decoded.shape == frames.shape
    assert np.abs(decoded - frames).mean() <= 12, np.abs(decoded - frames).mean()  # of 255
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(thumbnail))), frames[0])
    # the spritesheet: 8 of the 9 frames, evenly spaced, side by side
    sheet = np.asarray(Image.open(io.BytesIO(sprites)))
    assert np.array_equal(sheet, np.concatenate(list(frames[[0, 1, 2, 3, 5, 6, 7, 8]]), axis=1))
    assert listed == [video.id]
    # an adapter as for images: WanPipeline's frames after load_lora_weights, not the plain ones
    assert styled.status == "completed", styled.error
    adapted = (wan_video(wan_folder, request, lora=(style, 0.8)) * 255).round().astype(int)
    assert int(np.abs(styled_frames.astype(int) - adapted).max()) <= 2
    assert int(np.abs(styled_frames.astype(int) - frames).max()) > 10


def test_an_image_to_video_job_over_the_sdk_equals_wan_image_to_video_pipeline(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's `input_reference` file (a 48×40 PNG, resized to 32×32 as the pipeline resizes
    it): the job's frames equal WanImageToVideoPipeline's within 2/255; the stored job kept its
    frame (a PNG in the store's JSON)."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    from server.serving.videos import REFERENCE, open_job_store, to_request
    from server.serving.videostore import read_whole
    from tests.support.images import first_frame
    from tests.support.tiny_pipelines import build_wan_i2v_folder

    folder = build_wan_i2v_folder(tmp_path_factory.mktemp("wan") / "i2v")
    frame, png = first_frame(), tmp_path / "frame.png"
    frame.save(png)
    store = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    fast = {**FAST, "num_frames": 5, "num_inference_steps": 2}
    with live_server("--model", str(folder), "--job-store", store, "--drain-timeout-s", "0.5") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with png.open("rb") as file:
            video = client.videos.create(
                prompt="a red circle", size="32x32", input_reference=file, extra_body=fast
            )
        done = wait_until(
            lambda: (v := client.videos.retrieve(video.id)).status in ("completed", "failed") and v,
            120,
            "the image-to-video job",
        )
        assert done.status == "completed", done.error
        frames = frames_of(client.videos.download_content(video.id, variant="frames").read())
        without = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a cat", "size": "32x32"})
        assert without.status_code == 400 and "from an image" in without.json()["error"]["message"]
    jobs = open_job_store(store, "i2v", 1)  # a reader: the server that ran them has stopped
    record = jobs.get(video.id)
    assert record is not None and record.request.get("reference") is None  # beside it, not inside
    kept = to_request(record, read_whole(jobs.content(video.id, REFERENCE))).reference  # as a restart runs it
    assert np.array_equal(np.asarray(kept), np.asarray(frame))
    monkeypatch.setattr(pipeline_wan_i2v, "basic_clean", pipeline_wan.basic_clean)  # ftfy: see test_wan
    pipe = WanImageToVideoPipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        image=frame,
        prompt="a red circle",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=5.0,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
    ).frames[0]
    theirs = (theirs * 255).round().astype(int)
    assert frames.shape == theirs.shape == (5, 32, 32, 3)
    assert int(np.abs(frames.astype(int) - theirs).max()) <= 2


def test_a_job_cut_short_by_sigterm_completes_after_a_restart(wan_folder: Path, tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    args = ("--model", str(wan_folder), "--job-store", store, "--drain-timeout-s", "0.5")
    slow = {**FAST, "num_inference_steps": 40, "num_frames": 17}  # seconds, not a blink
    with live_server(*args) as server:
        made = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a red circle", "size": "64x64", **slow})
        job = made.json()["id"]
        wait_until(
            lambda: httpx.get(f"{server.url}/v1/videos/{job}").json()["progress"] > 0, 60, "the job running"
        )
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    with live_server(*args) as server:  # the same store: the job runs again, nobody sent it again
        done = wait_until(
            lambda: (v := httpx.get(f"{server.url}/v1/videos/{job}").json())["status"] == "completed" and v,
            120,
            "the job completing after the restart",
        )
        assert done["progress"] == 100
        first = httpx.get(f"{server.url}/v1/videos/{job}/content", params={"variant": "frames"}).content
    with live_server(*args) as server:  # a completed job's content outlives another restart
        again = httpx.get(f"{server.url}/v1/videos/{job}/content", params={"variant": "frames"})
        assert again.status_code == 200 and again.content == first
        assert frames_of(first).shape == (17, 64, 64, 3)
    # run again from its first step, its scheduler's history new: WanPipeline's frames
    request = GenerationRequest(
        "a red circle", seed=3, steps=40, guidance_scale=5.0, width=64, height=64, frames=17
    )
    theirs = (wan_video(wan_folder, request) * 255).round().astype(int)
    assert int(np.abs(frames_of(first).astype(int) - theirs).max()) <= 2


def bad_input_gets_a_4xx_naming_the_problem(base: str, first_keys_job: str) -> None:
    """As the key sk-first, whose job `first_keys_job` is."""
    url = f"{base}/v1/videos"
    client = httpx.Client(headers={"Authorization": "Bearer sk-first"})
    other_key = {"Authorization": "Bearer sk-second"}
    for path in (first_keys_job, f"{first_keys_job}/content", f"{first_keys_job}/events"):
        answer = client.get(f"{url}/{path}", headers=other_key)  # another key's job: as if none
        assert answer.status_code == 404 and "not yours" in answer.json()["error"]["message"], path

    def error(response: httpx.Response) -> tuple[int, str | None, str]:
        return (
            response.status_code,
            response.json()["error"]["param"],
            response.json()["error"]["message"],
        )

    assert error(client.post(url, json={"prompt": "a cat", "size": "33x32"}))[:2] == (400, "size")
    assert error(client.post(url, json={"prompt": "a cat", "size": "32x32", "seconds": "soon"}))[:2] == (
        400,
        "seconds",
    )
    status, param, message = error(client.post(url, json={"prompt": "a cat", "size": "32x32", "seconds": 8}))
    assert (status, param) == (400, "seconds") and "8 s is 129 frames at 16 fps" in message, message
    status, param, message = error(
        client.post(url, json={"prompt": "a cat", "size": "32x32", "num_frames": 10})
    )
    assert (status, param) == (400, "num_frames") and "1 more than a multiple of 4" in message
    # an unknown field: the hint is among the video body's fields, never the field itself (an
    # image request's `scheduler` was suggested for `scheduler`)
    status, param, message = error(client.post(url, json={"prompt": "a cat", "scheduler": "ddim"}))
    assert (status, param) == (400, "scheduler") and "did you mean" not in message, message
    status, param, message = error(client.post(url, json={"prompt": "a cat", "num_frame": 9}))
    assert (status, param) == (400, "num_frame") and "did you mean 'num_frames'" in message, message
    none = client.post(url, json={"prompt": "a cat", "size": "32x32", "num_frames": 0})
    assert error(none)[:2] == (400, "num_frames") and "got 0" in error(none)[2]  # not the default clip
    picture = client.post(
        url,
        data={"prompt": "a cat", "size": "32x32"},
        files={"input_reference": ("a.txt", b"not an image")},
    )
    status, param, message = error(picture)
    assert (status, param) == (400, "input_reference") and "not a png" in message, message
    png = io.BytesIO()
    Image.new("RGB", (32, 32)).save(png, format="PNG")
    text_only = client.post(
        url, data={"prompt": "a cat", "size": "32x32"}, files={"input_reference": ("a.png", png.getvalue())}
    )
    assert error(text_only)[:2] == (400, "input_reference") and "from text only" in error(text_only)[2]
    assert error(client.get(f"{url}/video_0123"))[0] == 404
    status, param, message = error(client.post(url, json={"prompt": "a cat", "lora": {"stlye": 1}}))
    assert (status, param) == (400, "lora") and "did you mean 'style'" in message, message
    status, param, message = error(client.post(url, json={"prompt": "a cat", "lora": {"style": 99}}))
    assert (status, param) == (400, "lora") and "between -4 and 4" in message, message
    form = client.post(url, files={"prompt": (None, "a cat"), "lora": (None, "style")})  # multipart
    assert error(form)[:2] == (400, "lora") and "not valid JSON" in error(form)[2]
    nested = {"step_cache[policy]": "first_block", "step_cache[threshold]": "2"}  # as the SDK sends objects
    form = client.post(url, files={"prompt": (None, "a cat"), **{k: (None, v) for k, v in nested.items()}})
    assert error(form)[:2] == (400, "step_cache.threshold") and "from 0 to 1, got 2" in error(form)[2]
    slow = client.post(url, json={"prompt": "a cat", "size": "64x64", **FAST, "num_inference_steps": 100})
    early = client.get(f"{url}/{slow.json()['id']}/content")
    assert early.status_code == 409 and early.json()["error"]["code"] == "video_not_ready"
    crowded = client.post(url, json={"prompt": "a cat", "size": "32x32", **FAST})  # one unfinished a key
    assert crowded.status_code == 429 and crowded.json()["error"]["code"] == "rate_limit_exceeded"
    assert client.get(f"{base}/readyz").status_code == 200  # and it keeps serving
    client.close()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_either_store_takes_jobs_once_bounds_them_and_runs_a_lost_one_again(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from server.serving.videos import open_job_store
    from server.serving.videostore import VideoJob, read_whole

    url = request.getfixturevalue("redis_url") if kind == "redis" else f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    model = f"m-{tmp_path.name}"  # a Redis is shared by this module's tests: a model's keys are its own
    store, other_model = open_job_store(url, model, lease_s=0.3), open_job_store(url, f"{model}-2", 0.3)
    for index, (expires, size) in enumerate([(50, 10), (500, 10), (400, 10), (None, 0)]):
        store.add(VideoJob(f"video_{index}", "key", model, "p", "32x32", "1", {}, created_at=index))
        if expires:  # taken (the oldest queued), made and finished
            job = store.claim("w")
            assert job is not None and job.id == f"video_{index}" and job.status == "in_progress"
            job.status, job.expires_at, job.bytes = "completed", expires, size
            assert store.finish(job, "w", {"video.mp4": b"x" * size})
    assert store.unfinished() == store.unfinished("key") == 1 and store.unfinished("other") == 0
    assert other_model.claim("w") is None  # a model sharing the store takes only its own jobs
    assert {k: v for k, v in store.counts().items() if v} == {"completed": 3, "queued": 1}
    assert store.tidy(now=100, max_bytes=10) == 2  # the expired one, then the first to expire
    assert store.content("video_0", "video.mp4") is None
    assert read_whole(store.content("video_1", "video.mp4")) == b"x" * 10
    assert [[j.id for j in page] for page, _ in [store.page("key", None, 1, "desc")]] == [["video_3"]]
    assert [j.id for j in store.page("key", "video_3", 5, "desc")[0]] == ["video_1"]
    assert store.page(None, None, 1, "asc")[1] is True  # more follow
    job = store.claim("w1")
    assert job is not None and job.id == "video_3" and store.claim("w2") is None  # taken once
    job.progress = 40
    assert store.progress(job, "w1") and store.get("video_3").progress == 40
    if kind == "redis":  # another replica's runner holds nothing; a lapsed lease frees the job
        assert not store.progress(job, "w2")
        assert wait_until(store.recover, 10, "the lease lapsing") == 1
        again = store.claim("w2")
        assert (
            again is not None
            and again.id == "video_3"
            and (again.status, again.progress) == ("in_progress", 0)
        )
        assert not store.finish(job, "w1", None)  # w1 lost it: its late result is not kept
    else:  # one server a file: the next start queues what a crash left in progress
        assert store.recover() == 1 and store.recover() == 0


def test_two_replicas_sharing_redis_answer_any_job_and_finish_a_dead_ones(
    wan_folder: Path, tmp_path: Path
) -> None:
    """A job made on one replica is polled and downloaded from the other; the replica running a
    long job is killed (SIGKILL) and the other runs it, as its progress events (read from the
    survivor) show; then Redis stops: the video routes answer 503 saying so, images are served."""
    slow = {**FAST, "num_inference_steps": 40, "num_frames": 17}
    with (
        redis_server(tmp_path) as redis,
        live_server("--model", str(wan_folder), "--job-store", redis.url, "--video-lease-s", "2") as one,
        live_server(
            "--model",
            str(wan_folder),
            "--job-store",
            redis.url,
            "--video-lease-s",
            "2",
            "--metrics-port",
            str(free_port()),
        ) as two,
    ):
        made = httpx.post(f"{one.url}/v1/videos", json={"prompt": "a red circle", "size": "32x32", **FAST})
        job = made.json()["id"]
        done = wait_until(
            lambda: (v := httpx.get(f"{two.url}/v1/videos/{job}").json())["status"] == "completed" and v,
            60,
            "the job completing, seen from the other replica",
        )
        assert done["progress"] == 100
        frames = [
            httpx.get(f"{s.url}/v1/videos/{job}/content", params={"variant": "frames"}) for s in (one, two)
        ]
        assert frames[0].status_code == 200 and frames[0].content == frames[1].content
        assert frames_of(frames[0].content).shape == (9, 32, 32, 3)
        metrics = httpx.get(two.metrics_url).text
        assert 'diffshard_video_jobs{state="completed"} 1.0' in metrics

        long = httpx.post(f"{one.url}/v1/videos", json={"prompt": "a blue square", "size": "64x64", **slow})
        job = long.json()["id"]
        runner = wait_until(
            lambda: next((s for s in (one, two) if s.stats()["engine"]["active_jobs"]), None), 60, "a runner"
        )
        survivor = two if runner is one else one
        with httpx.stream("GET", f"{survivor.url}/v1/videos/{job}/events", timeout=120) as events:
            seen = []
            for event, data in sse(events):
                seen.append((event, data))
                if event == "diffshard.progress" and data["step"] >= 2 and runner.process.poll() is None:
                    runner.process.kill()  # SIGKILL: no drain, no release; its lease lapses
        steps = [d["step"] for e, d in seen if e == "diffshard.progress" and d["status"] == "running"]
        assert steps and steps[-1] >= 2 and seen[-1][0] == "video.completed", seen[-5:]
        assert seen[-1][1]["id"] == job and seen[-1][1]["progress"] == 100
        content = httpx.get(f"{survivor.url}/v1/videos/{job}/content", params={"variant": "frames"})
        assert frames_of(content.content).shape == (17, 64, 64, 3)

        redis.stop()  # the store goes away: its routes say so, the rest serves on
        gone = httpx.get(f"{survivor.url}/v1/videos/{job}")
        assert gone.status_code == 503 and "job store cannot be reached" in gone.json()["error"]["message"]
        image = httpx.post(
            f"{survivor.url}/v1/images/generations",
            json={"prompt": "a cat", "size": "32x32", "num_inference_steps": 2},
        )
        assert image.status_code == 200 and httpx.get(f"{survivor.url}/readyz").status_code == 200


def test_an_image_model_answers_videos_404_saying_why(served) -> None:
    for method, path in (
        ("GET", "/v1/videos"),
        ("POST", "/v1/videos"),
        ("GET", "/v1/videos/video_1/content"),
    ):
        answer = httpx.request(
            method, f"{served.url}{path}", json={"prompt": "a cat"} if method == "POST" else None
        )
        assert answer.status_code == 404 and "makes images" in answer.json()["error"]["message"], path
