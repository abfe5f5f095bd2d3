"""ModelShard: same outputs as the unsharded model, blocks where the plan says, hooks undone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from server.engine import ModelShard, PlanError, plan_shards, spec_for
from tests.conftest import tiny_sd15_unet
from tests.support.reference import diffusers_forward


def reference(model: nn.Module, batch: int = 3):
    """Inputs with a different timestep per sample, and the unsharded output."""
    inputs = spec_for(model).example_inputs(model, batch, 16, torch.float32, torch.device("cpu"))
    assert len(set(inputs.timestep.tolist())) == batch
    with torch.inference_mode():
        expected = diffusers_forward(model, inputs)
    return inputs, expected


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["even", "memory"])
def test_sharded_output_is_bit_identical(tiny_unet: nn.Module, stages: int, strategy: str) -> None:
    inputs, expected = reference(tiny_unet)
    plan = plan_shards(tiny_unet, ["cpu"] * stages, strategy)
    assert len(plan.stages) == stages
    shard = ModelShard(tiny_unet, plan)
    out = shard(inputs.sample, inputs.timestep, inputs.context, **inputs.conditioning)
    assert torch.equal(out, expected)


def test_scalar_timestep_matches_too() -> None:
    unet = tiny_sd15_unet()
    inputs, _ = reference(unet)
    with torch.inference_mode():
        expected = unet(inputs.sample, 500, encoder_hidden_states=inputs.context).sample
    shard = ModelShard(unet, plan_shards(unet, "cpu,cpu,cpu", "even"))
    assert torch.equal(shard(inputs.sample, 500, inputs.context), expected)


def test_sharding_hooks_nothing() -> None:
    """The block walker moves the flow between stages itself: no module of a split model gets a
    hook, so the model still runs as diffusers' own, unchanged."""
    unet = tiny_sd15_unet()
    ModelShard(unet, plan_shards(unet, "cpu,cpu", "even"))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in unet.modules())


def test_introspection_agrees_with_the_plan() -> None:
    unet = tiny_sd15_unet()
    plan = plan_shards(unet, "cpu,cpu", "memory")
    shard = ModelShard(unet, plan)
    assert shard.blocks_on("cpu") == plan.blocks
    assert shard.device_of("mid_block") == "cpu"
    held = sum(p.numel() * p.element_size() for p in unet.parameters())
    held += sum(b.numel() * b.element_size() for b in unet.buffers())
    assert shard.param_bytes() == {"cpu": held}
    reading = shard.memory()["cpu"]
    assert reading.shard_bytes == held and reading.allocated is None  # no allocator on CPU
    text = str(shard)
    assert "ModelShard(UNet2DConditionModel" in text and "mid_block" in text


def test_a_plan_for_another_model_is_refused() -> None:
    unet = tiny_sd15_unet()
    from tests.conftest import tiny_sdxl_unet

    with pytest.raises(PlanError, match="not this model's"):
        ModelShard(unet, plan_shards(tiny_sdxl_unet(), "cpu", "even"))


def test_a_model_without_weights_is_refused() -> None:
    unet = tiny_sd15_unet()
    with torch.device("meta"):
        meta = type(unet).from_config(unet.config)
    with pytest.raises(PlanError, match="load them before sharding"):
        ModelShard(meta, plan_shards(meta, "cpu", "even"))
