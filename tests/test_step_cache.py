"""Step caching per row: the engine's walks against the denoisers' own forwards, rows that reuse
skipping the deep blocks (and a stage holding only those), and requests with caching on giving
batched the images they give alone, joining mid-way, beside uncached rows and adapters."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from server.engine import CallPlan, ModelShard, RowGroup, plan_shards
from server.engine.denoisers.specs import spec_for
from server.engine.planning.plan import Stage
from server.engine.runtime.call import CacheAsk
from server.errors import InvalidRequest
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.requests import GenerationRequest
from server.requests.step_cache import StepCache, parse_step_cache
from tests.conftest import tiny_sd15_unet, tiny_sdxl_unet
from tests.support.denoisers import tiny_flux_transformer, tiny_sd3_transformer
from tests.support.lora import random_lora
from tests.support.reference import diffusers_forward

TOLERANCE = 1e-3  # max abs difference of float images in [0, 1]
MODELS = {
    "sd15": tiny_sd15_unet,
    "sdxl": tiny_sdxl_unet,
    "sd3": tiny_sd3_transformer,
    "flux": tiny_flux_transformer,
}
DEEP = {
    "sd15": ("down_blocks.1", "mid_block", "up_blocks.0"),
    "sd3": ("transformer_blocks.1",),
    "flux": ("single_transformer_blocks.0",),
}


def example(model: torch.nn.Module, rows: int = 4):
    torch.manual_seed(0)
    return spec_for(model).example_inputs(model, rows, 16, torch.float32, torch.device("cpu"))


def count_rows(model: torch.nn.Module, names: tuple[str, ...]) -> dict[str, list[int]]:
    """Per module named: the rows of every call it gets (a forward hook)."""
    seen: dict[str, list[int]] = {name: [] for name in names}
    for name in names:

        def hook(_module, args, kwargs, name=name) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            seen[name].append(hidden.shape[0])

        model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def cached(*asks: CacheAsk | None) -> CallPlan:
    """A plan of 2-row groups, one per ask."""
    return CallPlan(tuple(RowGroup(2, cache=ask) for ask in asks))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_walk_with_every_row_refreshing_is_the_plain_forward(kind: str) -> None:
    model = MODELS[kind]().eval()
    inputs = example(model)
    plain = diffusers_forward(model, inputs)
    shard = ModelShard(model, plan_shards(model, "cpu"))
    walked = shard.run(inputs, cached(CacheAsk(), CacheAsk()))
    assert (walked.out - plain).abs().max() <= 1e-6
    assert all(o.refreshed and o.fresh for o in walked.outcomes)


@pytest.mark.parametrize("kind", ["sd15", "sd3", "flux"])
def test_reusing_rows_skip_the_deep_blocks_and_keep_their_own_features(kind: str) -> None:
    model = MODELS[kind]().eval()
    inputs = example(model)
    plain = diffusers_forward(model, inputs)
    shard = ModelShard(model, plan_shards(model, "cpu"))
    first = shard.run(inputs, cached(CacheAsk(), CacheAsk()))
    kept = [{name: t.clone() for name, t in o.fresh.items()} for o in first.outcomes]
    seen = count_rows(model, DEEP[kind])
    # the same inputs again: the first request reuses (DiTs decide by threshold 1: any change
    # under 100%; a UNet has no first block to decide by, and is told)
    decide = None if kind != "sd15" else False
    mixed = shard.run(inputs, cached(CacheAsk(kept[0], refresh=decide, threshold=1.0), CacheAsk()))
    assert all(rows == [2] for rows in seen.values())  # the deep blocks ran the second request only
    assert [o.refreshed for o in mixed.outcomes] == [False, True] and not mixed.outcomes[0].fresh
    assert (mixed.out - plain).abs().max() <= 1e-5  # its kept features were made from these inputs
    reuse = cached(*(CacheAsk(k, refresh=decide, threshold=1.0) for k in kept))
    shard.run(inputs, reuse)
    assert all(rows == [2] for rows in seen.values())  # a call of reusing rows calls no deep block


def test_rows_that_reuse_skip_a_stage_holding_only_deep_blocks() -> None:
    model = tiny_sd15_unet().eval()
    names = list(plan_shards(model, "cpu").blocks)
    cut = (names.index("down_blocks.1"), names.index(f"up_blocks.{len(model.up_blocks) - 1}"))
    parts = (names[: cut[0]], names[cut[0] : cut[1]], names[cut[1] :])
    plan = plan_shards(model, "cpu")
    plan = replace(plan, stages=tuple(Stage("cpu", tuple(p), (0,) * len(p)) for p in parts))
    shard = ModelShard(model, plan)
    inputs = example(model, rows=2)
    refreshed = shard.run(inputs, cached(CacheAsk()))
    deep_busy = shard.gates.stats().busy_s["cpu:1"]
    reused = shard.run(inputs, cached(CacheAsk(refreshed.outcomes[0].fresh, refresh=False)))
    assert shard.gates.stats().busy_s["cpu:1"] == deep_busy > 0  # never entered
    assert (reused.out - refreshed.out).abs().max() <= 1e-5


def test_the_setting_is_parsed_and_its_bad_values_named() -> None:
    assert parse_step_cache("deep") == StepCache("deep", 3)
    assert parse_step_cache('{"policy": "first_block", "threshold": 0.2}') == StepCache("first_block", 3, 0.2)
    assert parse_step_cache(None) == parse_step_cache("off") == StepCache()
    for value, field, words in [
        ("fast", "step_cache.policy", "one of off, deep, first_block"),
        ({"policy": "deep", "interval": 0}, "step_cache.interval", "from 1 to 10"),
        ({"policy": "deep", "interval": 2.5}, "step_cache.interval", "integer"),
        ({"policy": "first_block", "threshold": float("nan")}, "step_cache.threshold", "from 0 to 1"),
        ({"policy": "deep", "threshold": 0.1}, "step_cache.threshold", "not a parameter of the 'deep'"),
        ("{not json", "step_cache", "not valid JSON"),
        (3, "step_cache", "a policy name or an object"),
    ]:
        with pytest.raises(InvalidRequest, match=words) as caught:
            parse_step_cache(value)
        assert caught.value.field == field


def load(folder: Path) -> Pipeline:
    """Split in two stages (cpu, cpu): the walks also run through the ModelShard's hooks."""
    return Pipeline.load(folder, devices="cpu,cpu", strategy="even")


def run_together(pipeline: Pipeline, requests: list[GenerationRequest], ahead: int = 2) -> list[np.ndarray]:
    """The first request `ahead` steps ahead when the others join; every call steps them all."""
    requests = [pipeline.resolve(r) for r in requests]
    states = pipeline.start(requests[:1])
    for _ in range(ahead):
        pipeline.step(states)
    states += pipeline.start(requests[1:])
    while active := [s for s in states if not s.done]:
        pipeline.step(active)
    images = [image.numpy().copy() for image in pipeline.decode(states)]
    for state in states:
        state.close()
    return images


@pytest.mark.parametrize(
    ("kind", "policies"),
    [
        ("sd15", ["deep", {"policy": "deep", "interval": 2}, "off"]),
        ("sdxl", [{"policy": "deep", "interval": 2}, "deep", "off"]),
        # a tiny random MMDiT's first block moves 18-50% a step: thresholds that let it reuse
        (
            "sd3",
            [
                {"policy": "first_block", "threshold": 0.5},
                {"policy": "first_block", "threshold": 0.35},
                "off",
            ],
        ),
        (
            "flux",
            [
                {"policy": "first_block", "threshold": 0.5},
                {"policy": "first_block", "threshold": 0.35},
                "off",
            ],
        ),
    ],
)
def test_batched_equals_alone_with_caching_on(folders, sd3_folder, flux_folder, kind: str, policies) -> None:
    pipeline = load({"sd3": sd3_folder, "flux": flux_folder}.get(kind) or folders[kind])
    requests = [
        GenerationRequest("a red circle", seed=1, steps=8, guidance_scale=4.0, step_cache=parse_step_cache(p))
        for p in policies
    ]
    requests[1] = replace(requests[1], prompt="a blue square", seed=2, steps=7, partial_images=2)
    requests[2] = replace(requests[2], prompt="a green star", seed=3, steps=6, guidance_scale=1.0)
    if kind == "sd15":  # multistep and ancestral schedulers keep their own history beside the cache
        requests[0], requests[1] = (
            replace(requests[0], scheduler="dpmpp_2m"),
            replace(requests[1], scheduler="euler_a"),
        )
    alone, counts = [], []
    for request in requests:
        states, previews = pipeline.start([pipeline.resolve(request)]), 0
        while not states[0].done:
            pipeline.step(states)
            previews += states[0].preview is not None
        assert previews == request.partial_images
        alone.append(pipeline.decode(states)[0].numpy().copy())
        counts.append((states[0].cache.refreshed, states[0].cache.reused))
        states[0].close()
    together = run_together(pipeline, requests)
    for solo, batched in zip(alone, together, strict=True):
        assert float(np.abs(solo - batched).max()) < TOLERANCE
    assert counts[0][1] > 0 and counts[1][1] > 0 and counts[2] == (0, 0)  # they reused; off kept nothing
    uncached = pipeline.generate([replace(requests[0], step_cache=StepCache())])[0]
    assert float(np.abs(uncached - alone[0]).max()) > 0  # caching changed the image (a little)
    assert pipeline.pool.stats()["cpu"].bytes_in_use == 0  # kept features went back with the requests


def test_a_deep_row_refreshes_every_interval_steps_from_its_first(folders) -> None:
    pipeline = load(folders["sd15"])
    # DDIM: a call a step (the folder's PNDM takes its first timestep twice)
    request = GenerationRequest("a red circle", steps=7, step_cache=StepCache("deep", 3), scheduler="ddim")
    states = pipeline.start([pipeline.resolve(request)])
    outcomes = []
    while not states[0].done:
        pipeline.step(states)
        outcomes.append(states[0].cache.last)
    assert outcomes == ["refreshed", "reused", "reused"] * 2 + ["refreshed"]
    assert states[0].cache.nbytes > 0
    states[0].close()
    cancelled = pipeline.start([pipeline.resolve(request)])
    pipeline.step(cancelled)
    assert pipeline.pool.stats()["cpu"].bytes_in_use >= cancelled[0].cache.nbytes > 0
    cancelled[0].close()  # mid-way, as a client that leaves: what it kept goes back
    assert pipeline.pool.stats()["cpu"].bytes_in_use == 0


def test_adapters_apply_to_the_right_rows_when_only_some_refresh(folders, tmp_path: Path) -> None:
    pipeline = load(folders["sd15"])
    path = random_lora(folders["sd15"], tmp_path / "a.safetensors", seed=1, kind="sd15")
    pipeline.add_adapter(read_adapter("A", path, pipeline.family))
    deep = StepCache("deep", 2)
    requests = [
        GenerationRequest(
            "a red circle", seed=1, steps=6, guidance_scale=4.0, lora=(("A", 0.8),), step_cache=deep
        ),
        GenerationRequest("a blue square", seed=2, steps=5, guidance_scale=4.0, step_cache=deep),
    ]
    alone = [pipeline.generate([r])[0] for r in requests]
    together = run_together(pipeline, requests, ahead=1)  # the refresh phases differ by one step
    for solo, batched in zip(alone, together, strict=True):
        assert float(np.abs(solo - batched).max()) < TOLERANCE


@pytest.mark.parametrize(("kind", "policy"), [("sd15", "first_block"), ("sd3", "deep")])
def test_a_policy_the_model_cannot_run_is_refused_by_name(
    folders, sd3_folder, kind: str, policy: str
) -> None:
    pipeline = load(sd3_folder if kind == "sd3" else folders[kind])
    with pytest.raises(InvalidRequest, match="does not fit this model") as caught:
        pipeline.resolve(GenerationRequest("a red circle", step_cache=StepCache(policy)))
    assert caught.value.field == "step_cache"
