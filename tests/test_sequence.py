"""Sequence parallelism (issue 40): a DiT's tokens split over a group of ranks, in our process.

Engine: `Rank.attend` (Ulysses where heads divide, the keys and values gathered where they do
not) equals plain attention; a call split 2 and 3 ways equals the unsplit call for the tiny SD3
and FLUX transformers. Planner: FLUX.1-dev on two 80 GiB GPUs has a group of 2 predicted at
≤ 0.6× one device's lone step; auto splits a lone FLUX image's tokens and a lone SD3 image's
rows; a UNet is refused. Served: tiny SD3 and FLUX folders with `--devices cpu,cpu --parallel
sequence` give `--devices cpu`'s images and diffusers' within 2/255, batched, streamed and
step-cached; a helper thread killed mid-request fails that request with 503 and is replaced.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import FluxPipeline, StableDiffusion3Pipeline

from server.engine import CallPlan, ModelShard, plan_shards
from server.engine.denoisers.blocks import SequenceSplit
from server.engine.runtime.replicas import Workers, sharing_weights
from server.engine.runtime.sequence import Group, Rank, chunks, groups_for, run_sequence
from server.pipeline import Pipeline
from server.pipeline.loading.deployment import Lane
from server.requests import GenerationRequest
from server.requests.step_cache import StepCache
from tests.conftest import Cli
from tests.support.denoisers import as_request, sequence_lane, tiny_transformers
from tests.support.images import pixels
from tests.support.live import LiveServer, live_server
from tests.support.tiny_pipelines import diffusers_image
from tests.support.waiting import wait_until


def test_chunks_cut_like_tensor_split() -> None:
    for length in (1, 5, 77, 256):
        for parts in (1, 2, 3, 4):
            sizes = [t.numel() for t in torch.arange(length).tensor_split(parts)]
            assert [b - a for a, b in chunks(length, parts)] == sizes


@pytest.mark.parametrize("heads, degree", [(4, 2), (3, 2), (2, 3)])  # Ulysses, then KV gather
def test_a_ranks_attention_equals_attention_over_every_token(heads: int, degree: int) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, heads, 29, 8) for _ in range(3))  # 29 tokens: uneven slices
    whole = F.scaled_dot_product_attention(q, k, v)
    group = Group(["cpu"] * degree)
    split = SequenceSplit(frozenset(), {})
    cuts = chunks(29, degree)
    outs: list[torch.Tensor | None] = [None] * degree

    def rank(index: int) -> None:
        a, b = cuts[index]
        outs[index] = Rank(group, index, split).attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert torch.allclose(torch.cat(outs, dim=2), whole, atol=1e-6)


@pytest.mark.parametrize("degree", [2, 3])
@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_a_call_split_over_a_group_equals_the_unsplit_call(name: str, degree: int) -> None:
    model, inputs = tiny_transformers()[name]
    shards = [ModelShard(model, plan_shards(model, ["cpu"], "memory"))]
    shards += [ModelShard(sharing_weights(model), shards[0].plan) for _ in range(degree - 1)]
    plain = shards[0].run(inputs, CallPlan.plain(2)).out
    workers = Workers(degree - 1, 1)
    try:
        split = run_sequence(shards, shards[0].sequence, inputs, CallPlan.plain(2), workers.submit)
    finally:
        workers.close()
    assert split.out.shape == plain.shape
    assert torch.allclose(split.out, plain, atol=1e-5), float((split.out - plain).abs().max())
    assert split.exchange_s > 0  # the ranks did exchange


def test_a_call_uses_idle_replicas_by_rows_by_tokens_or_both() -> None:
    """A lone row: one group; rows that fill the replicas: split alone (nothing to exchange),
    unless every call must be a group; a guided image on 4: a half on each group of 2."""
    four = ["a", "b", "c", "d"]
    assert groups_for(four[:2], 1, every_call=False) == [["a", "b"]]
    assert groups_for(four[:2], 2, every_call=False) == []
    assert groups_for(four[:2], 6, every_call=True) == [["a", "b"]]
    assert groups_for(four, 2, every_call=False) == [["a", "b"], ["c", "d"]]
    assert groups_for(four[:3], 1, every_call=False) == [["a", "b", "c"]]


def test_guidance_in_parallel_on_two_groups_of_two_equals_the_unsplit_call() -> None:
    model, inputs = tiny_transformers()["sd3"]
    shards = [ModelShard(model, plan_shards(model, ["cpu"], "memory"))]
    shards += [ModelShard(sharing_weights(model), shards[0].plan) for _ in range(3)]
    lane = Lane(shards[0], Workers(3, 1), lambda: shards[1:], sequence=4)
    try:
        out = lane.forward(inputs, CallPlan.plain(2)).out
    finally:
        lane.workers.close()
    plain = shards[0].run(inputs, CallPlan.plain(2)).out
    assert torch.allclose(out, plain, atol=1e-5) and lane.groups.calls == 2
    assert all(shard.gates.stats().busy_s for shard in shards)  # every replica took part


# The planner's third axis.

FLUX_ON_TWO_H100 = (
    "plan",
    "--config",
    "flux-dev",
    "--devices",
    "cuda:0,cuda:1",
    "--max-memory",
    "cuda:0=80GiB,cuda:1=80GiB",
    "--dtype",
    "bfloat16",
    "--json",
)


def candidates(run_cli: Cli, *args: str) -> tuple[dict, list[dict]]:
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    parallel = json.loads(done.stdout)["parallel"]
    return parallel, parallel["candidates"]


def test_flux_dev_on_two_gpus_has_a_group_of_two_at_most_0_6_of_one_devices_lone_step(run_cli: Cli) -> None:
    parallel, found = candidates(run_cli, *FLUX_ON_TWO_H100, "--parallel", "sequence")
    group = next(c for c in found if c["sequence_degree"] == 2)
    one = next(c for c in found if c["note"].startswith("one device"))
    assert group["sequence_every_call"] and parallel["kind"] == "sequence" and parallel["lanes"] == 1
    assert group["predicted_lone_step_s"] <= 0.6 * one["predicted_lone_step_s"], (group, one)
    # auto: a replica per GPU under load, and a lone image's tokens split over both
    parallel, _ = candidates(run_cli, *FLUX_ON_TWO_H100)
    assert (parallel["kind"], parallel["sequence_degree"]) == ("replicas", 2)
    assert parallel["splits_lone_requests"]


def test_auto_splits_a_lone_sd3_images_rows_and_refuses_a_group_for_a_unet(run_cli: Cli) -> None:
    sd3 = (
        "plan",
        "--config",
        "sd3",
        "--devices",
        "cuda:0,cuda:1",
        "--max-memory",
        "cuda:0=80GiB,cuda:1=80GiB",
        "--dtype",
        "bfloat16",
        "--json",
    )
    parallel, _ = candidates(run_cli, *sd3)  # two guided rows: a row each beats splitting tokens
    assert parallel["splits_lone_requests"] and parallel["sequence_degree"] == 1
    done = run_cli("plan", "--config", "sd15", "--devices", "cpu,cpu", "--parallel", "sequence")
    assert done.returncode == 2 and "UNet2DConditionModel has no blocks to split" in done.stderr
    done = run_cli("plan", "--config", "flux-dev", "--devices", "cpu", "--parallel", "sequence")
    assert done.returncode == 2 and "two or more devices" in done.stderr


# Served: `--devices cpu,cpu --parallel sequence`.

REQUESTS = {
    "sd3": [
        {
            "prompt": "a red circle",
            "negative_prompt": "blue",
            "seed": 3,
            "num_inference_steps": 4,
            "guidance_scale": 4.0,
        },
        {"prompt": "a green square", "seed": 5, "num_inference_steps": 4, "guidance_scale": 6.0},
        {
            "prompt": "a white triangle",
            "seed": 7,
            "num_inference_steps": 5,
            "guidance_scale": 5.0,
            "step_cache": {"policy": "first_block", "threshold": 0.05},
        },
    ],
    "flux": [
        {"prompt": "a red circle", "seed": 3, "num_inference_steps": 4, "guidance_scale": 3.5},
        {"prompt": "a green square", "seed": 5, "num_inference_steps": 4, "guidance_scale": 5.0},
        {
            "prompt": "a blue triangle",
            "seed": 7,
            "num_inference_steps": 5,
            "guidance_scale": 3.5,
            "step_cache": {"policy": "first_block", "threshold": 0.05},
        },
    ],
}


def diffusers_reference(name: str, folder: Path, request: GenerationRequest) -> np.ndarray:
    if name == "sd3":
        pipe = StableDiffusion3Pipeline.from_pretrained(
            folder, text_encoder_3=None, tokenizer_3=None, local_files_only=True, use_safetensors=True
        )
    else:
        pipe = FluxPipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return diffusers_image(pipe, request)


@pytest.fixture(scope="module", params=["sd3", "flux"])
def grouped(request) -> Iterator[tuple[str, Path, LiveServer]]:
    folder = request.getfixturevalue(f"{request.param}_folder")  # the session's tiny folders
    args = ("--model", str(folder), "--devices", "cpu,cpu", "--parallel", "sequence", "--inject-faults")
    with live_server(*args) as server:
        yield request.param, folder, server


def test_a_group_serves_the_images_of_one_cpu_and_of_diffusers_batched_streamed_and_cached(grouped) -> None:
    name, folder, server = grouped
    bodies = [{**b, "size": "32x32"} for b in REQUESTS[name]]
    with httpx.Client(base_url=server.url, timeout=120) as client, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: client.post("/v1/images/generations", json=b), bodies))
        streamed = client.post(
            "/v1/images/generations", json={**bodies[0], "stream": True, "partial_images": 1}
        ).text
        parallel = client.get("/v1/shards").json()["parallel"]
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    served = [pixels(a.json()["data"][0]["b64_json"]) for a in answers]
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert [e["type"] for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    assert np.array_equal(pixels(events[-1]["b64_json"]), served[0])
    one_cpu = Pipeline.load(folder, devices="cpu")
    for body, image in zip(REQUESTS[name], served, strict=True):
        request = one_cpu.resolve(as_request(body))
        alone = (one_cpu.generate([request])[0] * 255).round().astype(int)
        assert int(np.abs(image - alone).max()) <= 2, body
        if request.step_cache is None:  # diffusers has no step caching to compare with
            theirs = (diffusers_reference(name, folder, request) * 255).round().astype(int)
            assert int(np.abs(image - theirs).max()) <= 2, body
    assert parallel["sequence_degree"] == 2 and parallel["sequence_every_call"]
    assert parallel["sequence_calls"] > 0 and min(parallel["busy_seconds"].values()) > 0


def test_a_helper_killed_mid_request_fails_it_with_503_and_is_replaced(grouped) -> None:
    name, _, server = grouped
    body = {**REQUESTS[name][0], "size": "32x32"}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        before = client.get("/v1/shards").json()["parallel"]["helper_restarts"]
        killed = client.post("/v1/images/generations", json={**body, "prompt": "[[kill-worker]] a cat"})
        assert killed.status_code == 503, killed.text
        error = killed.json()["error"]
        assert error["code"] == "worker_lost" and "restarted" in error["message"]
        assert "Traceback" not in killed.text and "WorkerDied" not in killed.text
        wait_until(lambda: client.get("/readyz").status_code == 200, 30, "the group is back")
        assert client.post("/v1/images/generations", json=body).status_code == 200
        assert client.get("/v1/shards").json()["parallel"]["helper_restarts"] == before + 1


def test_adapters_step_caching_and_int8_compose_with_a_group(sd3_folder: Path, tmp_path: Path) -> None:
    """One engine path: a request with a LoRA adapter and first-block caching on an int8-dynamic
    base, as a group of two (every call: `--parallel sequence`), gives its one-worker image."""
    from server.pipeline.conditioning.lora_keys import read_adapter
    from tests.support.lora import random_lora

    style = random_lora(sd3_folder, tmp_path / "style.safetensors", 1, "sd3")
    request = GenerationRequest(
        "a red circle",
        seed=3,
        steps=3,
        guidance_scale=4.0,
        width=32,
        height=32,
        lora=(("style", 0.8),),
        step_cache=StepCache("first_block", threshold=0.05),
    )

    def image(pipeline: Pipeline) -> np.ndarray:
        pipeline.add_adapter(read_adapter("style", style, pipeline.family))
        return pipeline.generate([pipeline.resolve(request)])[0]

    alone = image(Pipeline.load(sd3_folder, devices="cpu", quantize="int8-dynamic"))
    lane = sequence_lane(sd3_folder, quantize="int8-dynamic")
    assert float(np.abs(image(lane) - alone).max()) * 255 <= 2
    assert lane.lane.groups.calls == request.steps


def test_a_dead_helper_makes_the_lane_unready_until_it_recovers() -> None:
    """What /readyz reads (`Lane.lost`, in fixed words) from the helper's death to its
    replacement, the call it killed answered with WorkerLost (503), not a crash, and the next
    call served by fresh helpers."""
    from server.errors import WorkerLost

    model, inputs = tiny_transformers()["flux"]
    shards = [ModelShard(model, plan_shards(model, ["cpu"], "memory"))]
    shards.append(ModelShard(sharing_weights(model), shards[0].plan))
    lane = Lane(shards[0], Workers(1, 1), lambda: shards[1:], sequence=2)
    try:
        lane.workers.kill_next()
        with pytest.raises(WorkerLost):
            lane.forward(inputs, CallPlan.plain(2))
        assert lane.lost == "a helper thread of a lane died; fresh ones are starting"
        # the next call (a batch's jobs retried alone) replaces them first, and runs
        assert lane.forward(inputs, CallPlan.plain(2)).out.shape == inputs.sample.shape
        assert lane.lost is None and lane.workers.restarts == 1
        lane.recover()  # nothing lost: nothing restarted
        assert lane.workers.restarts == 1
    finally:
        lane.workers.close()


def test_a_rank_that_never_comes_breaks_the_exchange_after_its_timeout() -> None:
    """A rank lost before it started (its thread never submitted) cannot hold the others at the
    exchange forever (nor the process at exit, whose pool threads are not daemons): past the
    timeout the waiting rank raises GroupBroken (before: it waited for good)."""
    from server.engine.runtime.sequence import Group
    from server.errors import GroupBroken

    group = Group([torch.device("cpu"), torch.device("cpu")], timeout_s=0.2)
    with pytest.raises(GroupBroken):
        group.all_gather(0, 0, "rank 0's")
