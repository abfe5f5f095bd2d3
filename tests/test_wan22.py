"""Wan 2.2 (issue 51): A14B's two experts inside one batched step, TI2V-5B's per-frame timesteps,
a LoRA per expert, and the plans at published sizes, in-process (served over /v1/videos:
`tests/test_wan22_http.py`; held to WanPipeline and WanImageToVideoPipeline beside Wan 2.1:
`tests/test_video_families.py`). The tiny folders are `tests/support/tiny_wan22.py`'s (seeded,
offline): two experts of different weights switching at `boundary_ratio`."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from server.errors import InvalidRequest, ModelFolderError, PlanError
from server.pipeline import Pipeline
from server.pipeline.families import reference_family
from server.requests import GenerationRequest
from tests.support.tiny_wan22 import TI2V_SIZE, wan_video

VIDEO = {"width": 32, "height": 32, "frames": 9}
# 6 steps of the published UniPC scheduler at flow_shift 3: t = 999, 937 (high noise, ≥ 875), then
# 857, 750, 600, 376; at 20 steps 7 high-noise ones
STEPS, HIGH_STEPS = 6, 2


@pytest.fixture(scope="module")
def a14b_folder(tiny_folder) -> Path:
    return tiny_folder("wan2.2-a14b")


@pytest.fixture(scope="module")
def a14b(a14b_folder: Path) -> Pipeline:
    return Pipeline.load(a14b_folder, devices="cpu")


def alike(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def test_two_experts_make_wan_pipelines_video_each_with_its_guidance(a14b, a14b_folder) -> None:
    """`transformer` while t ≥ 0.875 × 1000 with guidance_scale, then `transformer_2` with
    guidance_scale_2; unset, the second scale is the first (as WanPipeline defaults it)."""
    assert a14b.family.experts == ("transformer", "transformer_2") and len(a14b.experts) == 2
    first, second = (d.replicas[0].model for d in a14b.experts)
    assert any(not torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(), strict=True))
    request = GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=STEPS, **VIDEO)
    videos = []
    for scales in ({"guidance_scale": 4.0, "guidance_scale_2": 2.0}, {"guidance_scale": 4.0}):
        asked = a14b.resolve(replace(request, **scales))
        before = dict(a14b.expert_steps.rows)
        videos.append(a14b.generate([asked])[0])
        assert alike(videos[-1], wan_video(a14b_folder, asked)) < 1e-6, scales  # well within 2/255
        ran = {name: rows - before[name] for name, rows in a14b.expert_steps.rows.items()}
        assert ran == {"transformer": 2 * HIGH_STEPS, "transformer_2": 2 * (STEPS - HIGH_STEPS)}
    assert alike(*videos) > 1e-5  # the second scale changes the low-noise steps (tiny weights: a little)
    longer = a14b.resolve(replace(request, steps=20, guidance_scale=4.0, guidance_scale_2=2.0))
    assert alike(a14b.generate([longer])[0], wan_video(a14b_folder, longer)) < 2 / 255  # UniPC's history


def test_three_videos_either_side_of_the_boundary_step_together_as_each_alone(a14b) -> None:
    """One video two steps in (below the boundary: the low-noise expert), then a 6-step and a
    20-step one joining (the high-noise expert) share steps: each step runs a call per expert, and
    each video equals what it gives alone; the mixed steps are counted (/v1/shards' parallel.experts)."""
    older = a14b.resolve(GenerationRequest("a red circle", seed=3, steps=STEPS, guidance_scale=4.0, **VIDEO))
    newer = a14b.resolve(
        GenerationRequest(
            "a blue square", seed=4, steps=STEPS, guidance_scale=5.0, guidance_scale_2=3.0, **VIDEO
        )
    )
    longer = a14b.resolve(GenerationRequest("a green line", seed=5, steps=20, guidance_scale=1.0, **VIDEO))
    alone = [a14b.generate([r])[0] for r in (older, newer, longer)]
    mixed = a14b.expert_steps.mixed_steps
    states = a14b.start([older])
    for _ in range(HIGH_STEPS):
        a14b.step(states)
    states += a14b.start([newer, longer])
    while active := [s for s in states if not s.done]:
        a14b.step(active)
    a14b.decode(states)
    for state, video in zip(states, alone, strict=True):
        assert alike(state.image.numpy(), video) < 1e-3
        state.close()
    # from the join: the longer's 7 high steps, beside the older's 4 low ones, then the newer's 2
    # last low ones (the newer's own 2 high ones fall among the first): 6 steps with both experts
    assert a14b.expert_steps.mixed_steps - mixed == 6


def test_first_block_caching_refreshes_at_the_expert_switch(a14b) -> None:
    """A cached video never reuses the high-noise expert's features in the low-noise expert:
    the first low step refreshes, whatever the threshold."""
    from server.requests.step_cache import StepCache

    cached = a14b.resolve(
        GenerationRequest(
            "a red circle",
            seed=3,
            steps=STEPS,
            guidance_scale=4.0,
            step_cache=StepCache("first_block", threshold=10.0),
            **VIDEO,
        )
    )
    (state,) = a14b.start([cached])
    outcomes = []
    try:
        while not state.done:
            a14b.step([state])
            outcomes.append((state.expert, state.cache.last))
    finally:
        state.close()
    assert outcomes[HIGH_STEPS] == (1, "refreshed"), outcomes  # the switch
    assert outcomes[1] == (0, "reused") and outcomes[-1] == (1, "reused"), outcomes  # a loose threshold


def test_both_experts_are_placed_by_one_plan_their_bytes_counted_and_quantized(a14b_folder) -> None:
    """Two stages: each device holds its blocks of both experts, as the plan counted them (twice
    one expert's); int8 quantizes both experts."""
    from server.engine.denoisers.blocks import tensor_bytes
    from server.serving import Service

    staged = Pipeline.load(a14b_folder, devices=["cpu", "cpu"], strategy="even")
    plan = staged.shard.plan
    one = staged.components.denoiser
    assert sum(s.param_bytes for s in plan.stages) == 2 * tensor_bytes(one, torch.float32)
    for deployment in staged.experts:
        shard = deployment.replicas[0]
        assert [s.blocks for s in shard.plan.stages] == [s.blocks for s in plan.stages]
    service = Service(staged, "tiny-a14b")
    try:
        held = sum(view.memory.shard_bytes for view in service.devices().values())
        assert held == 2 * tensor_bytes(one, torch.float32)
        assert service.parallel["experts"]["parts"] == ["transformer", "transformer_2"]
    finally:
        service.close()
    quantized = Pipeline.load(a14b_folder, devices="cpu", quantize="int8")
    for model in quantized.components.experts:
        assert type(model.blocks[0].attn1.to_q.weight).__name__ == "Int8Tensor"


def test_a14b_folders_are_checked_at_load_and_requests_by_field(a14b, a14b_folder, tmp_path) -> None:
    folder = Path(shutil.copytree(a14b_folder, tmp_path / "no-boundary"))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": None}))
    with pytest.raises(ModelFolderError, match="transformer_2 but no boundary_ratio"):
        Pipeline.load(folder, devices="cpu")
    (folder / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 1.5}))
    with pytest.raises(ModelFolderError, match=r"boundary_ratio must be between 0 and 1, got 1\.5"):
        Pipeline.load(folder, devices="cpu")
    with pytest.raises(InvalidRequest, match="finite number ≥ 0") as bad:
        a14b.resolve(GenerationRequest("a cat", guidance_scale_2=-1.0, **VIDEO))
    assert bad.value.field == "guidance_scale_2"


def test_a_one_transformer_wan_refuses_guidance_scale_2_by_name(tiny_folder) -> None:
    wan = Pipeline.load(tiny_folder("wan2.1"), devices="cpu")
    with pytest.raises(InvalidRequest, match="this model has one transformer") as bad:
        wan.resolve(GenerationRequest("a cat", guidance_scale_2=3.0, **VIDEO))
    assert bad.value.field == "guidance_scale_2"


def test_a14b_plans_at_published_sizes_count_both_experts(run_cli) -> None:
    """`plan --config wan2.2-t2v-a14b`: two 14 B experts (each Wan 2.1 14B's shape) on one 80 GiB
    GPU in bfloat16 beside UMT5-XXL, their bytes counted twice; on two 80 GiB GPUs, an expert
    each (auto: `experts`)."""
    gpus = ("cuda:0", "cuda:0=80GiB"), ("cuda:0,cuda:1", "cuda:0=80GiB,cuda:1=80GiB")
    done = [
        run_cli(
            "plan",
            "--config",
            name,
            "--devices",
            devices,
            "--max-memory",
            memory,
            "--dtype",
            "bfloat16",
            "--max-batch",
            "2",
            "--json",
        )
        for name, (devices, memory) in (
            ("wan2.2-t2v-a14b", gpus[0]),
            ("wan-14b", gpus[0]),
            ("wan2.2-t2v-a14b", gpus[1]),
        )
    ]
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    two, one = (sum(sum(s["block_bytes"]) for s in json.loads(d.stdout)["stages"]) for d in done[:2])
    assert two == 2 * one and two > 50 * 2**30
    apart = json.loads(done[2].stdout)["parallel"]
    assert apart["kind"] == "experts" and apart["replica_devices"] == [["cuda:0"], ["cuda:1"]]
    assert len(reference_family("wan2.2-i2v-a14b").experts) == 2


# Wan 2.2 TI2V-5B's image-to-video: a timestep per latent frame, the first one still.


@pytest.fixture(scope="module")
def ti2v_folder(tiny_folder) -> Path:
    return tiny_folder("wan2.2-ti2v")


def test_per_frame_timesteps_walk_as_diffusers_per_token_ones_split_or_not(ti2v_folder) -> None:
    """A [rows, frames] timestep (the first frame's 0) through our blocks, whole and as a sequence
    group of 2, equals the model's forward given WanPipeline's per-token timesteps."""
    from diffusers import WanTransformer3DModel

    from server.engine import CallPlan, ModelShard, plan_shards
    from server.engine.denoisers.blocks import DenoiserInputs
    from server.engine.runtime.replicas import Workers, sharing_weights
    from server.engine.runtime.sequence import run_sequence

    model = WanTransformer3DModel.from_pretrained(ti2v_folder / "transformer").eval()
    generator = torch.Generator().manual_seed(1)
    frames = torch.tensor([[0.0, 700.0, 700.0], [0.0, 300.0, 300.0]])
    inputs = DenoiserInputs(
        torch.randn(2, 48, 3, 4, 6, generator=generator), frames, torch.randn(2, 7, 32, generator=generator)
    )
    per_token = frames.repeat_interleave(2 * 3, dim=1)  # 2×3 tokens a latent frame
    with torch.inference_mode():
        expected = model(inputs.sample, per_token, inputs.context, return_dict=False)[0]
    shards = [ModelShard(model, plan_shards(model, ["cpu"], "memory"))]
    assert torch.allclose(shards[0].run(inputs, CallPlan.plain(2)).out, expected, atol=1e-6)
    shards.append(ModelShard(sharing_weights(model), shards[0].plan))
    workers = Workers(1, 1)
    try:
        out = run_sequence(shards, shards[0].sequence, inputs, CallPlan.plain(2), workers.submit).out
    finally:
        workers.close()
    assert torch.allclose(out, expected, atol=1e-5), float((out - expected).abs().max())


def test_ti2v_image_to_video_equals_wan_image_to_video_pipelines_joining_text_to_videos(ti2v_folder) -> None:
    """The same TI2V folder, under its UniPC scheduler (flow_shift 5): a video from a first frame
    (input_reference) equals WanImageToVideoPipeline's; it joins a 20-step text-to-video three
    steps in, a 6-step one joins three steps later, and each equals what it gives alone."""
    pipeline = Pipeline.load(ti2v_folder, devices="cpu")
    assert pipeline.family.pastes_first_frame
    frame = Image.new("RGB", (TI2V_SIZE, TI2V_SIZE), (200, 40, 40))
    size = {"width": TI2V_SIZE, "height": TI2V_SIZE, "frames": 9}
    longer = pipeline.resolve(
        GenerationRequest("a blue square", seed=4, steps=20, guidance_scale=5.0, **size)
    )
    from_image = pipeline.resolve(
        GenerationRequest(
            "a red circle",
            negative_prompt="blue",
            seed=3,
            steps=STEPS,
            guidance_scale=5.0,
            reference=frame,
            **size,
        )
    )
    shorter = pipeline.resolve(
        GenerationRequest("a green line", seed=5, steps=STEPS, guidance_scale=3.0, **size)
    )
    alone = [pipeline.generate([r])[0] for r in (longer, from_image, shorter)]
    assert alike(alone[1], wan_video(ti2v_folder, from_image, frame)) * 255 <= 2
    states = pipeline.start([longer])
    for joining in (from_image, shorter):
        for _ in range(3):
            pipeline.step(states)
        states += pipeline.start([joining])
    while active := [s for s in states if not s.done]:
        pipeline.step(active)
    pipeline.decode(states)
    for state, video in zip(states, alone, strict=True):
        assert alike(state.image.numpy(), video) < 1e-3
        state.close()


def test_a_lora_per_expert_equals_diffusers_loading_the_second_into_transformer_2(
    a14b, a14b_folder, tmp_path
) -> None:
    """One adapter file: `transformer.` keys for the high-noise expert, `transformer_2.` keys for
    the low-noise one, as WanPipeline.load_lora_weights(..., load_into_transformer_2=True) loads
    a second file; a row asking for it gets each expert's own deltas."""
    from diffusers import WanPipeline
    from safetensors.torch import load_file, save_file

    from server.pipeline.conditioning.lora_keys import read_adapter
    from tests.support.lora import random_wan_lora

    high = random_wan_lora(a14b_folder, tmp_path / "high.safetensors", 1)
    low = random_wan_lora(a14b_folder, tmp_path / "low.safetensors", 2)
    both = {
        **load_file(high),
        **{"transformer_2" + k.removeprefix("transformer"): v for k, v in load_file(low).items()},
    }
    save_file(both, tmp_path / "both.safetensors")
    adapter = read_adapter("both", tmp_path / "both.safetensors", a14b.family)
    assert adapter.describe()["parts"] == ["transformer", "transformer_2"]
    a14b.add_adapter(adapter)
    request = a14b.resolve(
        GenerationRequest(
            "a red circle", seed=3, steps=STEPS, guidance_scale=4.0, lora=(("both", 0.8),), **VIDEO
        )
    )
    mine = a14b.generate([request])[0]
    pipe = WanPipeline.from_pretrained(a14b_folder, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(high), adapter_name="both")
    pipe.load_lora_weights(str(low), adapter_name="both", load_into_transformer_2=True)
    pipe.set_adapters(["both"], [0.8])
    theirs = pipe(
        prompt=request.prompt,
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
    ).frames[0]
    assert alike(mine, theirs) * 255 <= 2
    plain = a14b.generate([a14b.resolve(replace(request, lora=()))])[0]
    assert alike(mine, plain) * 255 > 10


def test_ti2v_defaults_are_the_model_cards_and_it_fits_24_gib_quantized(run_cli) -> None:
    """TI2V-5B's default clip is 121 frames of 1280×704; one 24 GiB GPU holds it in int8 (its
    UMT5-XXL too), not in bfloat16."""
    ti2v = reference_family("wan2.2-ti2v-5b")
    assert (ti2v.clip.frames, ti2v.clip.size, ti2v.native_size) == (121, (1280, 704), 704)
    args = (
        "plan",
        "--config",
        "wan2.2-ti2v-5b",
        "--devices",
        "cuda:0",
        "--max-memory",
        "cuda:0=24GiB",
        "--dtype",
        "bfloat16",
    )
    quantized, whole = run_cli(*args, "--quantize", "int8", "--json"), run_cli(*args)
    assert quantized.returncode == 0, quantized.stderr
    assert json.loads(quantized.stdout)["quantize"]["modes"]["int8"]["fits"]
    assert whole.returncode != 0 and "do not fit cuda:0" in whole.stderr


def test_experts_apart_each_on_its_own_worker_give_what_one_device_gives(a14b, a14b_folder) -> None:
    """`--parallel experts` on two CPU workers: expert k's shard on worker k (auto picks it on
    distinct GPUs); videos either side of the boundary stepped together equal one device's, and
    each worker holds one expert's bytes."""
    from server.engine.denoisers.blocks import tensor_bytes
    from server.pipeline.loading.folder import read_family
    from server.pipeline.loading.model_plan import plan_model

    family = read_family(a14b_folder)
    plan = plan_model(
        family,
        ["cpu", "cpu"],
        "memory",
        dtype=torch.float32,
        batch=4,
        side=32,
        folder=a14b_folder,
        parallel="experts",
    )
    assert plan.experts_apart and plan.kind == "experts" and len(plan.replicas) == 2
    apart = Pipeline.load(a14b_folder, plan=plan)
    shards = [d.replicas[0] for d in apart.experts]
    assert shards[0] is not shards[1] and shards[0].model is not shards[1].model
    one = tensor_bytes(apart.components.denoiser, torch.float32)
    assert [sum(s.plan.stages[0].block_bytes) for s in shards] == [one, one]
    older = GenerationRequest("a red circle", seed=3, steps=STEPS, guidance_scale=4.0, **VIDEO)
    newer = GenerationRequest("a blue square", seed=4, steps=STEPS, guidance_scale=4.0, **VIDEO)
    alone = [a14b.generate([a14b.resolve(r)])[0] for r in (older, newer)]
    states = apart.start([apart.resolve(older)])
    for _ in range(HIGH_STEPS):
        apart.step(states)
    states += apart.start([apart.resolve(newer)])
    while active := [s for s in states if not s.done]:
        apart.step(active)
    apart.decode(states)
    for state, video in zip(states, alone, strict=True):
        assert alike(state.image.numpy(), video) < 1e-3
        state.close()
    assert apart.expert_steps.mixed_steps == HIGH_STEPS
    with pytest.raises(PlanError, match="a multiple of 2"):
        plan_model(
            family,
            ["cpu"],
            "memory",
            dtype=torch.float32,
            batch=4,
            side=32,
            folder=a14b_folder,
            parallel="experts",
        )
