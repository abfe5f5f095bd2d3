"""ControlNet residuals in the UNet's block walk (issue 54's engine part): a tiny ControlNet built
from a tiny UNet's config (its zero convolutions drawn at random: zeros would prove nothing), its
residuals passed as diffusers' UNet forward takes them. The walk equals diffusers' forward, over
one stage and over two; rows given zero residuals draw what they draw without a control; a
step-cached call's reusing rows add the shallow residuals where forward would."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    ControlNetModel,
    UNet2DConditionModel,
)

from server.engine import CallPlan, ModelShard, RowGroup, plan_shards
from server.engine.denoisers.blocks import DenoiserInputs, walk_plain
from server.engine.denoisers.specs import spec_for
from server.engine.denoisers.unet import CONTROL
from server.engine.runtime.call import CacheAsk
from server.pipeline import Pipeline
from server.pipeline.conditioning.adapters import Adapter, LoraPair
from server.requests.control import Control
from tests.conftest import TINY_UNETS
from tests.support.controlnets import (
    ASKED,
    EDIT_PIPELINES,
    EDITED,
    GUIDED,
    diffusers_controlled,
    folder_controlnet,
)
from tests.support.images import drawn

ROWS = 2


def control_for(unet: UNet2DConditionModel) -> ControlNetModel:
    torch.manual_seed(1)
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 8, 16, 16)).eval()
    for zero in [*net.controlnet_down_blocks, net.controlnet_mid_block]:
        torch.nn.init.normal_(zero.weight, std=0.5)
    return net


def inputs_of(unet: UNet2DConditionModel) -> tuple[DenoiserInputs, torch.Tensor]:
    """A call's inputs (the spec's example, its conditioning as the family passes it) and a
    control image at the latents' size × 8, as the ControlNet pipelines preprocess one."""
    example = spec_for(unet).example_inputs(unet, ROWS, 16, torch.float32, torch.device("cpu"))
    torch.manual_seed(2)
    return example, torch.rand(ROWS, 3, 16 * 8, 16 * 8)


def residuals(net: ControlNetModel, inputs: DenoiserInputs, image: torch.Tensor, scale: float) -> dict:
    down, mid = net(
        inputs.sample,
        inputs.timestep,
        encoder_hidden_states=inputs.context,
        controlnet_cond=image,
        conditioning_scale=scale,
        added_cond_kwargs=inputs.conditioning.get("added_cond_kwargs"),
        return_dict=False,
    )
    return dict(zip(CONTROL, (tuple(down), mid), strict=True))


def diffusers_forward(unet: UNet2DConditionModel, inputs: DenoiserInputs, control: dict) -> torch.Tensor:
    return unet(
        inputs.sample, inputs.timestep, inputs.context, **inputs.conditioning, **control, return_dict=False
    )[0]


def given(inputs: DenoiserInputs, control: dict) -> DenoiserInputs:
    return DenoiserInputs(inputs.sample, inputs.timestep, inputs.context, {**inputs.conditioning, **control})


def only_row_0(control: dict) -> dict:
    """The residuals a batch's rows get when only row 0 asked for the control: zeros on row 1."""
    keep = torch.tensor([1.0, 0.0]).view(-1, 1, 1, 1)
    return {k: tuple(r * keep for r in v) if isinstance(v, tuple) else v * keep for k, v in control.items()}


@pytest.mark.parametrize("name", sorted(TINY_UNETS))
@torch.inference_mode()
def test_the_walk_with_control_residuals_equals_diffusers_forward(name: str) -> None:
    unet = TINY_UNETS[name]()
    inputs, image = inputs_of(unet)
    control = residuals(control_for(unet), inputs, image, 0.7)
    assert control["mid_block_additional_residual"].abs().max() > 0.1  # a control that steers
    spec = spec_for(unet)
    ours, plain = walk_plain(spec, unet, given(inputs, control)), walk_plain(spec, unet, inputs)
    theirs = diffusers_forward(unet, inputs, control)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    assert (ours - plain).abs().max() > 1e-2  # the residuals changed the output
    mixed = walk_plain(spec, unet, given(inputs, only_row_0(control)))
    assert torch.allclose(mixed[0], ours[0], atol=1e-5) and torch.equal(mixed[1], plain[1])


@torch.inference_mode()
def test_over_two_stages_and_in_a_step_cached_call_the_residuals_land_where_forward_adds_them() -> None:
    """Split in two stages (the residuals cross with the flow), then DeepCache: a row that
    refreshed with its control, then reused its deep features on the same inputs, draws diffusers'
    controlled forward (its last up block adds the shallow residuals, counted from the bottom)."""
    unet = TINY_UNETS["sd15"]()
    inputs, image = inputs_of(unet)
    control = residuals(control_for(unet), inputs, image, 1.0)
    theirs = diffusers_forward(unet, inputs, control)
    split = ModelShard(unet, plan_shards(unet, "cpu,cpu", strategy="even"))
    assert len(split.plan.stages) == 2
    assert torch.allclose(split.run(given(inputs, control), CallPlan.plain(ROWS)).out, theirs, atol=1e-5)
    shard = ModelShard(unet, plan_shards(unet, "cpu"))
    refreshed = shard.run(given(inputs, control), CallPlan((RowGroup(ROWS, cache=CacheAsk()),)))
    reuse = CacheAsk(refreshed.outcomes[0].fresh, refresh=False)
    reused = shard.run(given(inputs, control), CallPlan((RowGroup(ROWS, cache=reuse),)))
    assert not reused.outcomes[0].refreshed
    assert torch.allclose(reused.out, theirs, atol=1e-5), (reused.out - theirs).abs().max()


TOLERANCE = 1e-3  # max abs difference of float images in [0, 1]


@pytest.fixture(scope="module")
def controlled(folders: dict[str, Path]) -> tuple[Pipeline, dict[str, ControlNetModel]]:
    """The tiny SD-1.5 pipeline over two stages, serving ControlNets "a" and "b"."""
    nets = {"a": folder_controlnet(folders["sd15"], 1), "b": folder_controlnet(folders["sd15"], 2)}
    pipeline = Pipeline.load(folders["sd15"], devices="cpu,cpu", strategy="even")
    for name, net in nets.items():
        pipeline.controlnets.add(name, copy.deepcopy(net))
    return pipeline, nets


@pytest.mark.parametrize("asked", list(ASKED.values()), ids=list(ASKED))
def test_images_equal_diffusers_controlnet_pipelines(
    folders: dict[str, Path], controlled: tuple[Pipeline, dict[str, ControlNetModel]], asked: list[Control]
) -> None:
    pipeline, nets = controlled
    ours = pipeline.generate([replace(GUIDED, control=tuple(asked))])[0]
    theirs = diffusers_controlled(folders["sd15"], [nets[c.model] for c in asked], asked)
    plain = pipeline.generate([GUIDED])[0]
    assert np.abs(ours - theirs).max() < TOLERANCE
    assert np.abs(ours - plain).max() > 0.02  # the control steered the image (5/255; a window too)
    assert ((ours > 0.01) & (ours < 0.99)).mean() > 0.5, "a saturated image would hide differences"


def test_a_batch_of_four_rows_each_as_alone_in_shared_calls(
    controlled: tuple[Pipeline, dict[str, ControlNetModel]],
) -> None:
    """Control "a" at 0.5, "b" at 1.0, "a" with a LoRA, and a plain request, stepped together:
    each draws its image alone within 1e-3; every step is one denoiser call of all 8 rows, and
    each ControlNet one call of only the rows that asked for it."""
    pipeline, _ = controlled
    layer = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    width = pipeline.shard.model.get_submodule(layer).in_features
    torch.manual_seed(0)
    pair = LoraPair(torch.randn(2, width), torch.randn(width, 2), alpha=2.0)
    if "red" not in pipeline.adapters.loaded:
        pipeline.add_adapter(Adapter("red", Path("red.safetensors"), {"unet": {layer: pair}}))
    circle, square = drawn("circle"), drawn("square")
    four = [
        replace(GUIDED, control=(Control("a", circle, 0.5),)),
        replace(GUIDED, seed=4, control=(Control("b", square, 1.0),)),
        replace(GUIDED, seed=5, control=(Control("a", square, 1.0),), lora=(("red", 1.0),)),
        replace(GUIDED, seed=6),
    ]
    alone = [pipeline.generate([request])[0] for request in four]
    rows: dict[str, list[int]] = {"unet": [], "a": [], "b": []}
    modules = {"unet": pipeline.shard.model.conv_in, **{n: pipeline.controlnets.loaded[n] for n in "ab"}}
    hooks = [
        m.register_forward_pre_hook(lambda _m, args, n=n: rows[n].append(args[0].shape[0]))
        for n, m in modules.items()
    ]
    try:
        together = pipeline.generate(four)
    finally:
        for hook in hooks:
            hook.remove()
    for mine, theirs in zip(together, alone, strict=True):
        assert np.abs(mine - theirs).max() < 1e-3
    calls = GUIDED.steps + 1  # SD 1.5's PNDM (PLMS) takes its first timestep twice, as the pipeline
    assert rows == {"unet": [8] * calls, "a": [4] * calls, "b": [2] * calls}, rows


def test_bad_controls_are_named_with_the_limit_and_a_foreign_net_is_refused() -> None:
    from server.errors import InvalidRequest
    from server.pipeline.conditioning.controlnets import ControlNets
    from server.pipeline.families.sd import SD
    from server.pipeline.families.sd3 import SD3
    from server.requests.control import MAX_CONTROLS

    nets = ControlNets(SD, torch.device("cpu"), torch.float32)
    nets.loaded["edges"] = torch.nn.Identity()  # checked by name only
    image = drawn("circle")
    cases = [
        ([Control("edgs", image)], "did you mean 'edges'"),
        ([Control("edges", image, scale=2.5)], "scale must be from 0 to 2.0; got 2.5"),
        ([Control("edges", image, start=0.6, end=0.4)], "0 ≤ start < end ≤ 1"),
        ([Control("edges", image)] * (MAX_CONTROLS + 1), f"at most {MAX_CONTROLS} controls"),
    ]
    for controls, says in cases:
        with pytest.raises(InvalidRequest, match=says) as caught:
            nets.check(controls)
        assert caught.value.field == "control"
    nets.check([Control("edges", image, 0.5, 0.2, 0.8)])  # fine
    with pytest.raises(ValueError, match="is a ControlNetModel: a sd3 model takes SD3ControlNetModel"):
        ControlNets(SD3, torch.device("cpu"), torch.float32).add("edges", control_for(TINY_UNETS["sd15"]()))


@pytest.mark.parametrize("kind", list(EDITED))
def test_control_with_an_edit_equals_diffusers_controlnet_edit_pipelines(
    folders: dict[str, Path], controlled: tuple[Pipeline, dict[str, ControlNetModel]], kind: str
) -> None:
    """img2img and inpainting with a control give StableDiffusionControlNet(Img2Img|Inpaint)Pipeline's
    image: the window counts the steps the edit's strength runs, as diffusers' `controlnet_keep`."""
    pipeline, nets = controlled
    edit, asked = EDITED[kind]
    request = pipeline.resolve(replace(GUIDED, edit=edit, control=tuple(asked)))
    ours = pipeline.generate([request])[0]
    masked = {"mask_image": edit.mask} if edit.mask else {}
    theirs = diffusers_controlled(
        folders["sd15"],
        [nets[c.model] for c in asked],
        asked,
        EDIT_PIPELINES[kind],
        image=edit.image,
        strength=edit.strength,
        **masked,
    )
    plain = pipeline.generate([replace(request, control=())])[0]
    assert np.abs(ours - theirs).max() < TOLERANCE, np.abs(ours - theirs).max()
    assert np.abs(ours - plain).max() > 0.05  # the control steered the edit
