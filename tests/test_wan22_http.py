"""Wan 2.2 served (issue 67): `tests/support/tiny_wan22.py`'s A14B and TI2V-5B folders, with the UniPC
scheduler their published folders ship, behind one live server each and driven by OpenAI's SDK.
Three jobs a server, at 20 and 6 steps, sent together (the 20-step one first), so they share
steps: each job's frames are within 2/255 of WanPipeline's (from a first frame,
WanImageToVideoPipeline's) for that request, and /v1/shards counts each expert's rows."""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from server.requests import GenerationRequest
from tests.support.live import live_server
from tests.support.tiny_wan22 import TI2V_SIZE, wan_video
from tests.support.waiting import wait_until

# openai 3.x warns on every videos call that OpenAI's own (Sora) service is scheduled to close
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
FRAMES = 9
# The published UniPC scheduler at flow_shift 3 (A14B) takes t = 999, 937 at 6 steps, then 857, …:
# 2 steps at or above the boundary (0.875 × 1000, the high-noise expert's); at 20 steps 7 (…, 900,
# 875, then 848)
HIGH_STEPS = {6: 2, 20: 7}
# One lane: on a host of two cores the planner serves two replicas, a lane each, and jobs running
# at once go to different lanes, never sharing a step.
SERVE = ("--drain-timeout-s", "0.5", "--parallel", "off")


@dataclass(frozen=True)
class Job:
    prompt: str
    steps: int
    seed: int
    guidance_scale: float
    guidance_scale_2: float | None = None
    negative_prompt: str | None = None
    reference: Image.Image | None = None  # sent as input_reference, a PNG

    def body(self) -> dict[str, Any]:
        """The SDK's extra_body, as the Videos API reads it."""
        given = {
            "num_frames": FRAMES,
            "num_inference_steps": self.steps,
            "seed": self.seed,
            "guidance_scale": self.guidance_scale,
            "guidance_scale_2": self.guidance_scale_2,
            "negative_prompt": self.negative_prompt,
        }
        return {name: value for name, value in given.items() if value is not None}

    def request(self, size: int) -> GenerationRequest:
        """The request WanPipeline is given for this job."""
        return GenerationRequest(
            self.prompt,
            negative_prompt=self.negative_prompt,
            seed=self.seed,
            steps=self.steps,
            guidance_scale=self.guidance_scale,
            guidance_scale_2=self.guidance_scale_2,
            width=size,
            height=size,
            frames=FRAMES,
        )


@dataclass
class Served:
    frames: list[np.ndarray]  # each job's, [frames, height, width, 3] uint8, in the order sent
    shards: dict
    stats: dict
    answers: dict[str, httpx.Response]  # other calls' answers, by what they asked


def frames_of(archive: bytes) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return np.stack([np.asarray(Image.open(io.BytesIO(z.read(n)))) for n in sorted(z.namelist())])


def send(client: openai.OpenAI, job: Job, size: int) -> str:
    extra = job.body()
    if job.reference is None:
        return client.videos.create(prompt=job.prompt, size=f"{size}x{size}", extra_body=extra).id
    png = io.BytesIO()
    job.reference.save(png, format="PNG")
    reference = ("frame.png", png.getvalue(), "image/png")
    return client.videos.create(
        prompt=job.prompt, size=f"{size}x{size}", input_reference=reference, extra_body=extra
    ).id


def run_together(client: openai.OpenAI, jobs: tuple[Job, ...], size: int) -> list[np.ndarray]:
    """Send every job at once, the longest first, then each one's frames. The runner takes each
    as it is queued (up to --max-running-videos, then as one ends), so the second joins the
    first's steps while the first still has most of its 20 to take (the first's prompt encoded,
    then its steps, against one create of the second's); the third joins once the second ends."""
    ids = [send(client, job, size) for job in jobs]
    for video_id in ids:
        done = wait_until(
            lambda v_id=video_id: (v := client.videos.retrieve(v_id)).status in ("completed", "failed") and v,
            120,
            f"job {video_id} finished",
        )
        assert done.status == "completed", done.error
    return [frames_of(client.videos.download_content(i, variant="frames").read()) for i in ids]


def within_2_of_255(folder: Path, jobs: tuple[Job, ...], served: list[np.ndarray], size: int) -> None:
    for job, frames in zip(jobs, served, strict=True):
        theirs = (wan_video(folder, job.request(size), job.reference) * 255).round().astype(int)
        assert frames.shape == theirs.shape == (FRAMES, size, size, 3)
        assert int(np.abs(frames.astype(int) - theirs).max()) <= 2, job


# A14B: two experts switching at boundary_ratio 0.875, each with its own guidance scale.
A14B_JOBS = (
    Job("a red circle", steps=20, seed=3, guidance_scale=4.0, guidance_scale_2=2.0, negative_prompt="blue"),
    Job("a blue square", steps=6, seed=4, guidance_scale=5.0),
    Job("a green line", steps=6, seed=5, guidance_scale=1.0),  # unguided: a row a step
)


@pytest.fixture(scope="module")
def a14b_folder(tiny_folder) -> Path:
    return tiny_folder("wan2.2-a14b")


@pytest.fixture(scope="module")
def a14b_served(a14b_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Served:
    """A14B_JOBS on one server, with what its /v1/shards, /v1/stats and /v1/models say after,
    and its answer to a bad second scale."""
    store = f"sqlite:///{tmp_path_factory.mktemp('a14b-jobs') / 'jobs.sqlite'}"
    with live_server("--model", str(a14b_folder), "--job-store", store, *SERVE) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        frames = run_together(client, A14B_JOBS, 32)
        shards, stats = httpx.get(f"{server.url}/v1/shards").json(), server.stats()
        answers = {
            "models": httpx.get(f"{server.url}/v1/models"),
            "bad": httpx.post(f"{server.url}/v1/videos", json={"prompt": "a cat", "guidance_scale_2": -1}),
        }
    return Served(frames, shards, stats, answers)


def test_a14b_video_jobs_over_the_sdk_at_6_and_20_steps_equal_wan_pipelines_and_count_their_experts(
    a14b_folder: Path, a14b_served: Served
) -> None:
    """Each job's frames within 2/255 of WanPipeline's for it (guidance_scale_2 in extra_body);
    /v1/shards counts each expert's rows: a guided step is 2 rows, an unguided one 1, and a job
    takes HIGH_STEPS of its steps on the high-noise expert; /v1/models names the experts; a bad
    second scale is a 400 naming it."""
    within_2_of_255(a14b_folder, A14B_JOBS, a14b_served.frames, 32)
    rows = {"transformer": 0, "transformer_2": 0}
    for job in A14B_JOBS:
        per_step = 2 if job.guidance_scale > 1 else 1
        rows["transformer"] += per_step * HIGH_STEPS[job.steps]
        rows["transformer_2"] += per_step * (job.steps - HIGH_STEPS[job.steps])
    assert (
        a14b_served.shards["parallel"]["experts"]["rows"] == rows == {"transformer": 20, "transformer_2": 38}
    )
    family = a14b_served.answers["models"].json()["data"][0]["family"]
    assert family["supports"]["experts"] == ["transformer", "transformer_2"]
    bad = a14b_served.answers["bad"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guidance_scale_2"


# TI2V-5B: one transformer, the 48-channel VAE; from text, or from a first frame pasted over the
# first latent frame.
def gradient(width: int, height: int) -> Image.Image:
    ys, xs = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([xs * 3, ys * 4, (xs + ys) * 2], -1).astype(np.uint8))


TI2V_JOBS = (
    Job("a blue square", steps=20, seed=4, guidance_scale=5.0),
    Job(
        "a red circle",
        steps=6,
        seed=3,
        guidance_scale=5.0,
        negative_prompt="blue",
        reference=gradient(80, 56),
    ),  # resized to the video's size, as the pipeline resizes it
    Job("a green line", steps=6, seed=5, guidance_scale=3.0),
)


@pytest.fixture(scope="module")
def ti2v_folder(tiny_folder) -> Path:
    return tiny_folder("wan2.2-ti2v")


@pytest.fixture(scope="module")
def ti2v_served(ti2v_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Served:
    store = f"sqlite:///{tmp_path_factory.mktemp('ti2v-jobs') / 'jobs.sqlite'}"
    with live_server("--model", str(ti2v_folder), "--job-store", store, *SERVE) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        frames = run_together(client, TI2V_JOBS, TI2V_SIZE)
        shards, stats = httpx.get(f"{server.url}/v1/shards").json(), server.stats()
    return Served(frames, shards, stats, {})


def test_ti2v_video_jobs_from_text_and_from_a_first_frame_equal_wan_pipelines(
    ti2v_folder: Path, ti2v_served: Served
) -> None:
    """One TI2V server takes text-to-video jobs at 20 and 6 steps and an image-to-video one (the
    SDK's input_reference): each within 2/255 of WanPipeline's, the latter of
    WanImageToVideoPipeline's on the same folder."""
    within_2_of_255(ti2v_folder, TI2V_JOBS, ti2v_served.frames, TI2V_SIZE)


@pytest.mark.parametrize("served", ["a14b_served", "ti2v_served"])
def test_video_jobs_sent_while_another_runs_join_its_steps(
    served: str, request: pytest.FixtureRequest
) -> None:
    """The step loop batches rows of several requests: a job sent while another is stepping joins
    it, so some step holds the rows of more than one video (a guided one's are 2)."""
    batch_rows = request.getfixturevalue(served).stats["engine"]["batch_rows"]
    assert max(int(rows) for rows in batch_rows) > 2, batch_rows
