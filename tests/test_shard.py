"""ModelShard: same outputs as the unsharded model, blocks where the plan says, hooks undone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from server.engine import ModelShard, PlanError, layout_of, plan_shards, spec_for
from tests.conftest import tiny_sd15_unet


def reference(model: nn.Module, batch: int = 3):
    """Inputs with a different timestep per sample, and the unsharded output."""
    inputs = spec_for(model).example_inputs(model, batch, 16, torch.float32, torch.device("cpu"))
    assert len(set(inputs.timestep.tolist())) == batch
    with torch.inference_mode():
        expected = spec_for(model).forward(model, inputs)
    return inputs, expected


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["even", "memory"])
def test_sharded_output_is_bit_identical(tiny_unet: nn.Module, stages: int, strategy: str) -> None:
    inputs, expected = reference(tiny_unet)
    plan = plan_shards(tiny_unet, ["cpu"] * stages, strategy)
    assert len(plan.stages) == stages
    with ModelShard(tiny_unet, plan) as shard:
        out = shard(inputs.sample, inputs.timestep, inputs.context, **inputs.conditioning)
    assert torch.equal(out, expected)


def test_scalar_timestep_matches_too() -> None:
    unet = tiny_sd15_unet()
    inputs, _ = reference(unet)
    with torch.inference_mode():
        expected = unet(inputs.sample, 500, encoder_hidden_states=inputs.context).sample
    with ModelShard(unet, plan_shards(unet, "cpu,cpu,cpu", "even")) as shard:
        assert torch.equal(shard(inputs.sample, 500, inputs.context), expected)


def test_block_modules_are_hooked_once_and_unhooked_on_exit() -> None:
    """Split: each block module gets one hook (its stage's gate, and the move to a later stage's
    device), nothing else does; one stage needs none."""
    unet = tiny_sd15_unet()
    modules = [m for b in layout_of(unet).blocks for m in b.modules]
    with ModelShard(unet, plan_shards(unet, "cpu,cpu", "even")):
        assert all(len(unet.get_submodule(path)._forward_pre_hooks) == 1 for path in modules)
        assert sum(len(m._forward_pre_hooks) for m in unet.modules()) == len(modules)
    assert not any(m._forward_pre_hooks for m in unet.modules())
    with ModelShard(unet, plan_shards(unet, "cpu", "even")):
        assert not any(m._forward_pre_hooks for m in unet.modules())


def test_introspection_agrees_with_the_plan() -> None:
    unet = tiny_sd15_unet()
    plan = plan_shards(unet, "cpu,cpu", "memory")
    with ModelShard(unet, plan) as shard:
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
