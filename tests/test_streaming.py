"""Streaming partial images (`stream: true`), driven by the official openai SDK against the real
server: partial images are the model's predictions of the finished image, getting closer; the
completed image is the non-streamed one byte for byte; a client that leaves is cancelled and its
buffers return; streams and plain requests share the loop."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from server.api.streaming import KEEPALIVE, Feed, image_events
from server.errors import Cancelled
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.serving import Job
from tests.support.live import LiveServer, live_server, sse
from tests.support.waiting import wait_until

EXTRA = {"seed": 3, "num_inference_steps": 12}


@pytest.fixture(scope="module")
def server(served: LiveServer) -> LiveServer:
    return served


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64)))).astype(int)


def streamed(client: openai.OpenAI, prompt: str, **fields) -> list:
    """Every event of a streamed generation at 64x64 (unless `size` says otherwise), EXTRA's seed
    and steps unless `extra_body` says otherwise."""
    fields = {"size": "64x64", **fields, "extra_body": {**EXTRA, **fields.get("extra_body", {})}}
    return list(client.images.generate(prompt=prompt, stream=True, **fields))


def test_two_partial_images_then_the_completed_one(client: openai.OpenAI) -> None:
    events = streamed(client, "a red circle", partial_images=2)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    images = [pixels(e.b64_json) for e in events]
    assert all(i.shape == (64, 64, 3) for i in images)
    assert all((e.size, e.output_format) == ("64x64", "png") for e in events)
    final = images[-1]
    earlier, later = (float(np.abs(i - final).mean()) for i in images[:2])
    assert later < earlier, (earlier, later)  # the predictions converge on the image
    plain = client.images.generate(prompt="a red circle", size="64x64", extra_body=EXTRA)
    assert base64.b64decode(plain.data[0].b64_json) == base64.b64decode(events[-1].b64_json)
    assert events[-1].model_extra["seed"] == plain.data[0].model_extra["seed"] == EXTRA["seed"]


def test_n_images_are_told_apart_and_zero_partials_streams_only_the_final(client: openai.OpenAI) -> None:
    events = streamed(client, "a blue square", n=2, partial_images=1)
    kinds = [(e.type, e.model_extra["image_index"]) for e in events]
    seeds = {e.model_extra["image_index"]: e.model_extra["seed"] for e in events if "seed" in e.model_extra}
    assert seeds == {0: EXTRA["seed"], 1: EXTRA["seed"] + 1}
    assert sorted(kinds) == sorted(
        [("image_generation.partial_image", i) for i in (0, 1)]
        + [("image_generation.completed", i) for i in (0, 1)]
    )
    only = streamed(client, "a blue square")
    assert [e.type for e in only] == ["image_generation.completed"]
    jpeg = streamed(client, "a blue square", size="64x48", partial_images=1, output_format="jpeg")
    assert all(Image.open(io.BytesIO(base64.b64decode(e.b64_json))).size == (64, 48) for e in jpeg)
    assert all(Image.open(io.BytesIO(base64.b64decode(e.b64_json))).format == "JPEG" for e in jpeg)


def test_every_image_of_a_large_n_gets_its_partial_images(client: openai.OpenAI) -> None:
    """A step hands over one partial image per image at once: the buffer holds a whole round."""
    events = streamed(client, "a red circle", n=10, partial_images=2)
    partials = sorted(
        (e.model_extra["image_index"], e.partial_image_index)
        for e in events
        if e.type == "image_generation.partial_image"
    )
    assert partials == [(image, k) for image in range(10) for k in (0, 1)]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"partial_images": 2}, "partial_images"),
        ({"stream": True, "partial_images": 4}, "partial_images"),
        ({"stream_progress": True}, "stream_progress"),
    ],
)
def test_bad_stream_fields_are_refused_by_name(server: LiveServer, fields, param) -> None:
    response = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "a red circle", **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_stream_progress_counts_the_steps_and_leaves_the_images_alone(server: LiveServer) -> None:
    body = {"prompt": "a red circle", "size": "64x64", "stream": True, "stream_progress": True, **EXTRA}
    with httpx.stream("POST", f"{server.url}/v1/images/generations", json=body, timeout=60) as response:
        events = list(sse(response))
    progress = [data for event, data in events if event == "diffshard.progress"]
    assert all(p["type"] == "diffshard.progress" and p["steps"] == 12 for p in progress)
    steps = [p["step"] for p in progress if p["status"] == "running"]
    assert steps == sorted(steps) and steps[-1] == 12 and len(set(steps)) > 1, steps
    assert events[-1][0] == "image_generation.completed"
    body.pop("stream_progress")
    with httpx.stream("POST", f"{server.url}/v1/images/generations", json=body, timeout=60) as response:
        without = list(sse(response))
    assert [event for event, _ in without] == ["image_generation.completed"]
    assert without[-1][1]["b64_json"] == events[-1][1]["b64_json"]


def test_a_queued_stream_hears_its_place_in_line_then_its_steps() -> None:
    """One request at a time (--max-batch 2: a guided image takes 2 rows): the third request to
    arrive waits second in line, then first once the running one is cancelled, then runs."""
    with live_server("--max-batch", "2", "--parallel", "off") as small, ThreadPoolExecutor(2) as pool:
        url = f"{small.url}/v1/images/generations"
        body = {"prompt": "a red circle", "stream": True, "stream_progress": True, "seed": 1}

        def places(steps: int) -> list[tuple]:
            with httpx.stream("POST", url, json={**body, "num_inference_steps": steps}, timeout=60) as r:
                return [(d["status"], d["queue_position"]) for e, d in sse(r) if e == "diffshard.progress"]

        long = {**body, "num_inference_steps": 100, "n": 4}
        with httpx.stream("POST", url, json=long, timeout=60) as first:
            events = sse(first)  # held: a generator collected now would close the response
            assert next(d for _, d in events if d.get("status") == "running")
            second = pool.submit(places, 30)
            small.wait_for(lambda s: s["engine"]["queue_depth"] == 1)
            third = pool.submit(places, 5)
            small.wait_for(lambda s: s["engine"]["queue_depth"] == 2)
        # the first request's client left: it is cancelled at the next step, and the line moves
        assert second.result()[0] == ("queued", 1)
        seen = third.result()
    in_line = [place for status, place in seen if status == "queued"]
    assert in_line == [2, 1], seen
    assert {status for status, _ in seen[len(in_line) :]} == {"running"}


def test_a_client_that_leaves_mid_stream_is_cancelled_and_its_buffers_return(server: LiveServer) -> None:
    before = server.stats()["engine"]["rejected"].get("cancelled", 0)
    body = {"prompt": "a red circle", "stream": True, "partial_images": 3, "num_inference_steps": 100, "n": 4}
    with httpx.stream("POST", f"{server.url}/v1/images/generations", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: image_generation.partial_image"):
                break  # one partial image seen: leave
    server.wait_for(lambda s: s["engine"]["rejected"].get("cancelled", 0) == before + 1)

    def pool_when_all_returned() -> dict | None:
        pool = httpx.get(f"{server.url}/v1/shards").json()["pool"]
        return pool if all(p["bytes_in_use"] == 0 for p in pool.values()) else None

    assert wait_until(pool_when_all_returned, 30, "every pooled buffer returned")
    errors = [line for line in server.log if " ERROR " in line or "never retrieved" in line]
    assert not errors, errors  # a client leaving is news to nobody (the test below pins the asyncio part)


def test_an_abandoned_stream_leaves_no_outcome_unretrieved() -> None:
    """The stream's end, then its job's: asyncio must have nothing to report when the outcome's
    future is collected (it used to log "Future exception was never retrieved" at ERROR)."""

    async def abandon() -> list[str]:
        reported: list[str] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda _, context: reported.append(context["message"])
        )
        job = Job([GenerationRequest("a red circle", steps=2)], 2, 60.0)
        events = image_events(job, Feed(), {"output_format": "png"}, None, "r1", keepalive_s=0.01)
        assert await anext(events) == KEEPALIVE  # the stream is running
        await events.aclose()  # its client left
        ended = asyncio.Event()
        job.future.add_done_callback(lambda _: ended.set())  # on this thread: set_exception below
        job.future.set_exception(Cancelled("the client disconnected"))
        await ended.wait()
        for _ in range(3):  # the wrapped future's copy of the outcome lands on the next ticks
            await asyncio.sleep(0)
        del events
        gc.collect()
        return reported

    assert asyncio.run(abandon()) == []


def test_a_queued_stream_hears_keep_alives_while_it_waits_and_then_completes() -> None:
    """Behind a long request (one image at a time), a stream with no progress events asked for
    would be silent; it gets an SSE comment every --sse-keepalive-s instead, until its images."""
    keepalive_s = 0.3
    with live_server("--max-batch", "2", "--parallel", "off", "--sse-keepalive-s", str(keepalive_s)) as small:
        url = f"{small.url}/v1/images/generations"
        long = {"prompt": "a blue square", "num_inference_steps": 100, "n": 2, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=60) as first:
            assert first.status_code == 200
            body = {"prompt": "a red circle", "stream": True, "num_inference_steps": 4}
            arrived: list[tuple[float, str]] = []
            with httpx.stream("POST", url, json=body, timeout=60) as queued:
                stream = queued.iter_lines()  # one iterator, read on after the first leaves
                for line in stream:
                    if line:
                        arrived.append((time.monotonic(), line))
                        if len([1 for _, seen in arrived if seen.startswith(":")]) == 3:
                            break  # heard three keep-alives while queued
                first.close()  # the long request's client leaves: the queued one runs
                for line in stream:
                    if line:
                        arrived.append((time.monotonic(), line))
    lines = [line for _, line in arrived]
    assert lines[:3] == [": keep-alive"] * 3, lines[:5]
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(arrived[:3])]
    assert all(gap < keepalive_s * 4 for gap in gaps), gaps  # one every keepalive_s, give or take
    assert "event: image_generation.completed" in lines


def test_eight_streams_and_eight_plain_requests_all_complete(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def last_event(seed: int) -> str:
        return streamed(client, "a green square", partial_images=2, extra_body={"seed": seed})[-1].type

    def plain(seed: int) -> int:
        result = client.images.generate(
            prompt="a green square", size="64x64", extra_body={**EXTRA, "seed": seed}
        )
        return len(result.data)

    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(last_event, seed) for seed in range(8)]
        plains = [pool.submit(plain, seed) for seed in range(8)]
        assert [f.result() for f in streams] == ["image_generation.completed"] * 8
        assert [f.result() for f in plains] == [1] * 8


@pytest.mark.parametrize(
    ("kind", "scheduler"), [("sd15", "dpmpp_2m"), ("sd15", "euler"), ("sd15", "default"), ("sd3", "default")]
)
def test_every_scheduler_gives_partial_images_without_changing_the_result(
    folders, sd3_folder, kind: str, scheduler: str
) -> None:
    """DPM-Solver converts its prediction, Euler returns it, flow matching derives it, SD 1.5's
    PNDM keeps only its noise schedule (alpha-bar at t): each gives a preview, and asking for
    previews leaves the final image as it was."""
    pipeline = Pipeline.load(sd3_folder if kind == "sd3" else folders[kind], devices="cpu")
    request = GenerationRequest("a red circle", seed=1, steps=6, scheduler=scheduler, width=32, height=32)
    previews: list[tuple[int, Any]] = []  # (index, [H, W, 3] image tensor)
    plain = pipeline.generate([request])[0]
    streamed = pipeline.generate(
        [GenerationRequest(**{**vars(request), "partial_images": 2})],
        on_step=lambda states: previews.extend(s.preview for s in states if s.preview is not None),
    )[0]
    assert [index for index, _ in previews] == [0, 1]
    np.testing.assert_array_equal(plain, streamed)
    # each an estimate of the image to come: nearer it the later it is taken, the last near it
    (_, early), (_, late) = previews
    off = [float(np.abs(image.numpy() - plain).mean()) for image in (early, late)]
    assert off[1] < off[0] and off[1] < 0.1, off
