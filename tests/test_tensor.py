"""Tensor parallelism (issue 52, a first part): a DiT's blocks split over a tensor group, each
rank holding its share of the Linear layers (heads, MLPs, packed outputs, AdaLN modulation),
partial outputs summed in rank order. Tiny SD3 and FLUX.1 transformers (built from config, seed
0) and their tiny folders, on CPU workers: a group equals one device, and each rank holds about
half of the split blocks' bytes, measured from the placed tensors."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from server.engine import CallPlan, ModelShard, plan_shards, spec_for
from server.engine.denoisers.blocks import tensor_bytes
from server.engine.runtime.replicas import Workers, sharing_weights
from server.engine.runtime.tensor import run_tensor, split_model
from server.errors import PlanError
from server.pipeline import Pipeline
from server.pipeline.loading.folder import read_family
from server.pipeline.loading.model_plan import plan_model
from server.requests import GenerationRequest
from tests.support.denoisers import tiny_transformers

RANK_SHARE = 0.55  # the issue's bound: a rank holds at most this part of the split blocks' bytes


def tiny_denoisers() -> dict[str, tuple[torch.nn.Module, object]]:
    from tests.support.denoisers import tiny_wan, video_inputs

    return {**tiny_transformers(), "wan": (tiny_wan(), video_inputs())}


def group_of_two(model: torch.nn.Module, inputs) -> tuple[torch.Tensor, torch.Tensor, list[float], frozenset]:
    """`model`'s unsplit call on `inputs`, the same call over a tensor group of two (the model
    becomes rank 0), each rank's share of the split blocks' bytes, and the split blocks."""
    shard = ModelShard(model, plan_shards(model, ["cpu"], "memory"))
    with torch.inference_mode():
        plain = shard.run(inputs, CallPlan.plain(2)).out
    split = shard.spec.tensor(model)
    whole = sum(tensor_bytes(model.get_submodule(b)) for b in split.blocks)
    ranks = [model, sharing_weights(model)]
    for index, rank in enumerate(ranks):
        split_model(rank, split, index, len(ranks))
    shares = [sum(tensor_bytes(rank.get_submodule(b)) for b in split.blocks) / whole for rank in ranks]
    shards = [ModelShard(rank, plan_shards(rank, ["cpu"], "memory")) for rank in ranks]
    workers = Workers(1, 1)
    try:
        out = run_tensor(shards, split, inputs, CallPlan.plain(2), workers.submit).out
    finally:
        workers.close()
    return plain, out, shares, split.blocks


@pytest.mark.parametrize("name", ["flux", "sd3", "wan"])
def test_a_call_over_a_tensor_group_equals_the_unsplit_call(name: str) -> None:
    """Wan's q/k norms span every head: each rank's mean of squares is summed over the group."""
    plain, out, shares, _ = group_of_two(*tiny_denoisers()[name])
    assert max(shares) <= RANK_SHARE, shares
    assert torch.allclose(out, plain, atol=1e-5), float((out - plain).abs().max())


def test_a_group_that_does_not_divide_the_heads_is_refused_by_name() -> None:
    model, _ = tiny_transformers()["flux"]  # 2 heads
    split = ModelShard(model, plan_shards(model, ["cpu"], "memory")).spec.tensor(model)
    with pytest.raises(PlanError, match="must divide the attention heads"):
        split_model(sharing_weights(model), split, 0, 3)


@pytest.fixture(scope="module")
def folders(flux_folder, sd3_folder, tiny_folder) -> dict[str, Path]:
    """The tiny folders the other modules share (conftest's)."""
    return {"flux": flux_folder, "sd3": sd3_folder, "wan": tiny_folder("wan2.1")}


VIDEO = {"width": 32, "height": 32, "frames": 9}
SMALL = {"width": 32, "height": 32}  # the tiny folders' own default is larger: each step costs more


@pytest.mark.parametrize("name", ["flux", "sd3", "wan"])
def test_a_pipeline_on_two_workers_as_a_tensor_group_makes_one_devices_images(folders, name: str) -> None:
    """`--devices cpu,cpu --parallel tensor`: the planner's group of two, each rank's plan
    counting its share; guided and plain images (two rows and one, batched; Wan's videos) within
    2/255 of one device's, and first-block caching agreed over the ranks."""
    from server.requests.step_cache import StepCache

    folder = folders[name]
    one = Pipeline.load(folder, devices="cpu")
    plan = plan_model(
        read_family(folder),
        ["cpu", "cpu"],
        "memory",
        dtype=torch.float32,
        batch=4,
        side=64,
        folder=folder,
        parallel="tensor",
    )
    assert plan.kind == "tensor" and plan.tensor == 2 and plan.lanes == 1
    group = Pipeline.load(folder, plan=plan)
    split = group.replicas[0].tensor

    def planned(stage) -> int:  # the split blocks' bytes a plan's stage counts
        return sum(n for b, n in zip(stage.blocks, stage.block_bytes, strict=True) if b in split.blocks)

    whole = planned(plan_shards(one.components.denoiser, ["cpu"], "memory").stages[0])
    assert all(planned(r.stages[0]) <= RANK_SHARE * whole for r in plan.replicas)
    size = VIDEO if name == "wan" else SMALL
    requests = [
        GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=4, **size),
        GenerationRequest("a blue square", seed=4, steps=4, guidance_scale=1.0, **size),
        GenerationRequest(
            "a green star", seed=5, steps=6, step_cache=StepCache("first_block", threshold=0.5), **size
        ),
    ]
    mine = group.generate([group.resolve(r) for r in requests])
    for image, request in zip(mine, requests, strict=True):
        alone = one.generate([one.resolve(request)])[0]
        assert float(np.abs(image - alone).max()) * 255 <= 2
    denoiser = one.components.denoiser
    whole_split = sum(tensor_bytes(denoiser.get_submodule(b)) for b in split.blocks)
    for shard in group.replicas:
        held = sum(tensor_bytes(shard.model.get_submodule(b)) for b in split.blocks)
        assert held <= RANK_SHARE * whole_split


def test_tensor_groups_refuse_what_they_cannot_split_yet(folders) -> None:
    flux = read_family(folders["flux"])  # 2 heads
    with pytest.raises(PlanError, match="3 does not divide the attention heads"):
        plan_model(
            flux,
            ["cpu"] * 3,
            "memory",
            dtype=torch.float32,
            batch=4,
            side=64,
            folder=folders["flux"],
            parallel="tensor",
        )
    with pytest.raises(PlanError, match="nf4 and GGUF files are not split"):
        plan_model(
            flux,
            ["cpu", "cpu"],
            "memory",
            dtype=torch.float32,
            batch=4,
            side=64,
            folder=folders["flux"],
            parallel="tensor",
            quantize={"*": "nf4"},
        )


def test_lora_rows_beside_cached_and_plain_ones_in_a_group_give_what_they_give_alone(
    folders, tmp_path_factory
) -> None:
    """On an int8 base (each rank quantizes its share of a layer, cut from the float weights as it
    is placed), an adapter in a tensor group: each rank holds its part of every pair (B's rows
    where the layer's outputs are cut, A's columns where its inputs are, the partial deltas
    summed), so a LoRA image equals one int8 device's within 2/255; a LoRA row, a
    first-block-cached one and a plain one in one call each equal what they give alone within 1e-3."""
    from server.pipeline.conditioning.lora_keys import read_adapter
    from server.requests.step_cache import StepCache
    from tests.support.lora import random_lora

    sd3 = folders["sd3"]
    lora = random_lora(sd3, tmp_path_factory.mktemp("lora") / "style.safetensors", 1, "sd3")
    plan = plan_model(
        read_family(sd3),
        ["cpu", "cpu"],
        "memory",
        dtype=torch.float32,
        batch=4,
        side=64,
        folder=sd3,
        parallel="tensor",
        quantize={"*": "int8"},
    )
    group = Pipeline.load(sd3, plan=plan, quantize="int8")
    one = Pipeline.load(sd3, devices="cpu", quantize="int8")
    split = group.replicas[1].model.transformer_blocks[0].attn.to_out[0]
    assert (
        type(split.weight).__name__ == "Int8Tensor" and split.weight.shape[1] * 2 == split.rank_part.whole[1]
    )
    for pipeline in (group, one):
        pipeline.add_adapter(read_adapter("style", lora, pipeline.family))
    requests = [
        GenerationRequest("a red circle", seed=3, steps=4, lora=(("style", 0.8),), **SMALL),
        GenerationRequest(
            "a blue square", seed=4, steps=6, step_cache=StepCache("first_block", threshold=0.5), **SMALL
        ),
        GenerationRequest("a green star", seed=5, steps=4, **SMALL),
    ]
    alone = [group.generate([group.resolve(r)])[0] for r in requests]
    styled_on_one = one.generate([one.resolve(requests[0])])[0]
    assert float(np.abs(alone[0] - styled_on_one).max()) * 255 <= 2
    plain = one.generate([one.resolve(GenerationRequest("a red circle", seed=3, steps=4, **SMALL))])[0]
    assert float(np.abs(styled_on_one - plain).max()) * 255 > 10  # the adapter changes the image
    together = group.generate([group.resolve(r) for r in requests])
    for mine, expected in zip(together, alone, strict=True):
        assert float(np.abs(mine - expected).max()) < 1e-3


def test_a_unets_transformer_blocks_split_its_convolutions_whole(tmp_path_factory) -> None:
    """A UNet in a tensor group: the attention and GEGLU feed-forward of its transformer blocks
    split, its convolutions whole on every rank; equal to the unsplit call. What that gains: a
    rank holds 84% of those blocks' bytes on the tiny SD 1.5 (its Linear layers are 27% of it;
    SD 1.5's are about a third)."""
    from server.pipeline.loading.folder import load_components
    from tests.support.tiny_pipelines import build_sd15_folder

    model = load_components(build_sd15_folder(tmp_path_factory.mktemp("tensor-unet") / "sd15")).denoiser
    inputs = spec_for(model).example_inputs(model, 2, 16, torch.float32, torch.device("cpu"))
    plain, out, shares, blocks = group_of_two(model, inputs)
    assert blocks == {"down_blocks.0", "mid_block", "up_blocks.1"}
    assert all(0.8 < share < 0.9 for share in shares), shares
    assert torch.allclose(out, plain, atol=1e-5), float((out - plain).abs().max())


NEWER = ("flux2", "qwen-image", "z-image", "hunyuanvideo-1.5", "ltx-2", "ltx-2.3", "flux3", "flux3-distilled")


@pytest.mark.parametrize("name", NEWER)
def test_the_newer_families_split_as_declared(tmp_path_factory, name: str) -> None:
    """FLUX.2 and Qwen-Image as diffusers' own `_tp_plan` declares them (FLUX.2's fused
    single-block projections as packed parts; Qwen-Image's modulation gathered beside it), Z-Image
    by our declaration (its SwiGLU; a tiny one 48 wide, whose 128 MLP features halve), and
    HunyuanVideo-1.5 as SD3's MMDiT, LTX-2 its six attentions and two feed-forwards a block, FLUX.3
    every mode's blocks and the joint ones by heads and SwiGLU halves: a group of two equals the
    unsplit call, each rank ≤ 0.55 of the split blocks."""
    from server.pipeline.loading.folder import load_components
    from tests.support.tiny_flux2 import build_flux2_folder
    from tests.support.tiny_flux3 import build_flux3_folder
    from tests.support.tiny_hunyuan15 import build_hunyuan15_folder
    from tests.support.tiny_ltx2 import build_ltx2_folder
    from tests.support.tiny_qwenimage import build_qwen_image_folder
    from tests.support.tiny_zimage import build_zimage_pipeline

    if name == "z-image":
        model = build_zimage_pipeline(dim=48, axes_dims=[12, 6, 6]).transformer
    else:
        build = {
            "flux2": build_flux2_folder,
            "qwen-image": build_qwen_image_folder,
            "hunyuanvideo-1.5": build_hunyuan15_folder,
            "ltx-2": build_ltx2_folder,
            "ltx-2.3": partial(build_ltx2_folder, version="2.3"),  # its gated attention: per head
            "flux3": build_flux3_folder,
            "flux3-distilled": partial(build_flux3_folder, variant="distilled"),  # a target timestep too
        }[name]
        model = load_components(build(tmp_path_factory.mktemp("tensor") / name)).denoiser
    inputs = spec_for(model).example_inputs(model, 2, 8, torch.float32, torch.device("cpu"))
    plain, out, shares, _ = group_of_two(model, inputs)
    assert max(shares) <= RANK_SHARE, shares
    assert torch.allclose(out, plain, atol=1e-5), float((out - plain).abs().max())


def test_layouts_2x1x2_and_1x2x2_serve_tensor_groups_as_one_device(folders) -> None:
    """`--devices cpu,cpu,cpu,cpu --layout 2x1x2`: two replicas, each a tensor group of two, a
    lane each (the Service steps them at once); `1x2x2`: one replica of two stages, each stage a
    tensor group of two (a rank's stages on its two devices); every image within 2/255 of one
    device's."""
    from server.serving import Service

    folder = folders["flux"]
    one = Pipeline.load(folder, devices="cpu")
    requests = [
        GenerationRequest(f"a red circle {i}", negative_prompt="blue", seed=i, steps=2, **SMALL)
        for i in range(3)
    ]
    alone = [one.generate([one.resolve(r)])[0] for r in requests]
    family, devices = read_family(folder), ["cpu"] * 4
    plan = plan_model(
        family, devices, "memory", dtype=torch.float32, batch=4, side=64, folder=folder, layout="2x1x2"
    )
    assert (plan.kind, plan.tensor, plan.lanes, len(plan.replicas)) == ("tensor", 2, 2, 4)
    service = Service(Pipeline.load(folder, plan=plan), "tensor", max_batch=4)
    try:
        assert len(service.loops) == 2 and service.parallel["tensor_degree"] == 2
        jobs = [service.submit([r]) for r in requests]
        images = [job.future.result(timeout=120)[0] for job in jobs]
    finally:
        service.close()
    for image, expected in zip(images, alone, strict=True):
        assert float(np.abs(image - expected).max()) * 255 <= 2
    staged = plan_model(
        family, devices, "memory", dtype=torch.float32, batch=4, side=64, folder=folder, layout="1x2x2"
    )
    assert (staged.tensor, staged.stages, staged.lanes, len(staged.replicas)) == (2, 2, 1, 2)
    group = Pipeline.load(folder, plan=staged)
    for image, expected in zip(group.generate([group.resolve(r) for r in requests]), alone, strict=True):
        assert float(np.abs(image - expected).max()) * 255 <= 2


def test_flux2_dev_on_two_gpus_plans_a_tensor_group_quicker_alone_than_two_stages(run_cli) -> None:
    """`plan --config flux2-dev` on two 80 GiB GPUs at the default 16 rows a step: the group of two
    fits with Mistral 3's 43.6 GiB spread over both ranks (`parts.spread_encoder`), 21.8 GiB each,
    and auto takes it, its lone step ≤ 0.6× the two stages'; on 8 GPUs the candidates include
    4 × 1 × 2-way, 2 × 1 × 4-way and 2 × 2 × 2-way, each with its figures."""
    import json

    common = ("plan", "--config", "flux2-dev", "--dtype", "bfloat16", "--json")
    two = ("--devices", "cuda:0,cuda:1", "--max-memory", "cuda:0=80GiB,cuda:1=80GiB")
    done = run_cli(*common, *two)
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)
    parallel = planned["parallel"]
    assert parallel["kind"] == "tensor" and parallel["tensor_degree"] == 2 and planned["batch"] == 16
    found = parallel["candidates"]
    group = next(c for c in found if c["tensor_degree"] == 2)
    stages = next(c for c in found if c["stages"] == 2 and c["tensor_degree"] == 1)
    assert group["predicted_lone_step_s"] <= 0.6 * stages["predicted_lone_step_s"], (group, stages)
    held = parallel["replica_other_bytes"]  # each rank's half of Mistral 3; the VAE on the first
    assert all(21 * 2**30 < n < 23 * 2**30 for n in held) and held[0] > held[1], held
    eight = ",".join(f"cuda:{i}" for i in range(8))
    memory = ",".join(f"cuda:{i}=80GiB" for i in range(8))
    found = json.loads(run_cli(*common, "--devices", eight, "--max-memory", memory).stdout)["parallel"]
    shapes = {(c["replicas"], c["stages"], c["tensor_degree"]): c for c in found["candidates"]}
    assert {(4, 1, 2), (2, 1, 4), (2, 2, 2), (1, 2, 4)} <= set(shapes)
    assert shapes[2, 2, 2]["predicted_rows_per_s"] and shapes[2, 2, 2]["predicted_lone_step_s"]


def test_ranks_placed_on_devices_get_parameters_of_their_own_over_the_same_storage() -> None:
    """CUDA moves a Parameter in place: ranks sharing one Parameter object would move each
    other's. `own_parameters` gives a rank fresh Parameters over the same tensors (nothing copied)."""
    from server.engine.runtime.replicas import own_parameters

    model, _ = tiny_transformers()["flux"]
    rank = sharing_weights(model)
    own_parameters(rank)
    pairs = list(zip(model.parameters(), rank.parameters(), strict=True))
    assert all(p is not q and p.data_ptr() == q.data_ptr() for p, q in pairs)


def test_a_server_on_two_workers_as_a_tensor_group_serves_one_devices_images(flux_folder) -> None:
    """`serve --devices cpu,cpu --parallel tensor` on a loopback port: images over HTTP within 2/255
    of one device's (a batch of a guided and an unguided request), /v1/shards saying the degree."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.support.denoisers import as_request
    from tests.support.images import pixels
    from tests.support.live import live_server

    bodies = [
        {
            "prompt": "a red circle",
            "negative_prompt": "blue",
            "seed": 3,
            "num_inference_steps": 3,
            "guidance_scale": 3.5,
            "size": "32x32",
        },
        {
            "prompt": "a blue square",
            "seed": 4,
            "num_inference_steps": 3,
            "guidance_scale": 3.5,
            "size": "32x32",
        },
    ]
    args = ("--model", str(flux_folder), "--devices", "cpu,cpu", "--parallel", "tensor")
    with live_server(*args) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda b: client.post("/v1/images/generations", json=b), bodies))
        shards = client.get("/v1/shards").json()
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert shards["parallel"]["tensor_degree"] == 2 and shards["parallel"]["lanes"] == 1
    one = Pipeline.load(flux_folder, devices="cpu")
    whole = sum(one.shard.param_bytes().values())
    assert [r["devices"] for r in shards["tensor_ranks"]] == [["cpu"], ["cpu"]]
    assert all(whole / 2 < r["weight_bytes"] < whole for r in shards["tensor_ranks"]), (whole, shards)
    for body, answer in zip(bodies, answers, strict=True):
        alone = (one.generate([one.resolve(as_request(body))])[0] * 255).round().astype(int)
        assert int(np.abs(pixels(answer.json()["data"][0]["b64_json"]) - alone).max()) <= 2


def test_the_planner_prices_each_exchange_a_tensor_groups_block_makes() -> None:
    """Counted from the spec's cuts, as the runtime exchanges them (issue 68): FLUX.1's double
    block sums 4 row-cut partials and gathers 2 outputs, Wan's block sums 3 and reduces 4 norms;
    a sum moves (T-1) whole partials a rank (4× a ring's bytes at T = 8), a gather (T-1)/T."""
    from server.engine.planning.sequence import Link
    from server.engine.planning.tensor import Exchanges, tensor_exchanges
    from server.pipeline.families import reference_family
    from server.pipeline.loading.model_plan import meta_denoiser

    counted = {}
    for name in ("flux-dev", "wan-14b"):
        model = meta_denoiser(reference_family(name))
        counted[name] = set(tensor_exchanges(model, spec_for(model).tensor(model)).values())
    assert counted["flux-dev"] == {Exchanges(sums=4, gathers=2), Exchanges(sums=1, gathers=1)}
    assert counted["wan-14b"] == {Exchanges(sums=3, norms=4)}
    link = Link(bytes_per_s=1e9, sync_s=0.0)
    assert Exchanges(sums=1).seconds(1e6, 8, link) == pytest.approx(7e-3)  # a ring: 2 · 7/8 · 1e6 bytes
    assert Exchanges(gathers=1).seconds(1e6, 8, link) == pytest.approx(7e-3 / 8)
    assert Exchanges(norms=5).seconds(1e6, 8, Link(1e9, sync_s=1e-4)) == pytest.approx(5e-4)
