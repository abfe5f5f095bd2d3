"""ControlNet residuals in the UNet's block walk (issue 54's engine part): a tiny ControlNet built
from a tiny UNet's config (its zero convolutions drawn at random: zeros would prove nothing), its
residuals passed as diffusers' UNet forward takes them. The walk equals diffusers' forward, over
one stage and over two; rows given zero residuals draw what they draw without a control; a
step-cached call's reusing rows add the shallow residuals where forward would."""

from __future__ import annotations

import pytest
import torch
from diffusers import ControlNetModel, UNet2DConditionModel

from server.engine import CallPlan, ModelShard, RowGroup, plan_shards
from server.engine.denoisers.blocks import DenoiserInputs, walk_plain
from server.engine.denoisers.specs import spec_for
from server.engine.denoisers.unet import CONTROL
from server.engine.runtime.call import CacheAsk
from tests.conftest import TINY_UNETS

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
        inputs.sample, inputs.timestep, encoder_hidden_states=inputs.context, controlnet_cond=image,
        conditioning_scale=scale, added_cond_kwargs=inputs.conditioning.get("added_cond_kwargs"),
        return_dict=False,
    )  # fmt: skip
    return dict(zip(CONTROL, (tuple(down), mid), strict=True))


def diffusers_forward(unet: UNet2DConditionModel, inputs: DenoiserInputs, control: dict) -> torch.Tensor:
    return unet(inputs.sample, inputs.timestep, inputs.context, **inputs.conditioning, **control,
                return_dict=False)[0]  # fmt: skip


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
