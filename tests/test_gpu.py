"""On a CUDA host: a mixed cuda:0 + cpu plan runs, matches the GPU model and places every weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from server.engine import ModelShard, layout_of, plan_shards
from server.engine.blocks import spec_for

pytestmark = pytest.mark.gpu


def test_mixed_cuda_and_cpu_plan_matches_the_gpu_model(tiny_unet: nn.Module) -> None:
    spec = spec_for(tiny_unet)
    unet = tiny_unet.to("cuda:0")
    inputs = spec.example_inputs(unet, 3, 16, torch.float32, torch.device("cuda:0"))
    with torch.inference_mode():
        expected = spec.forward(unet, inputs)

    names = layout_of(unet).names
    cut = names.index("mid_block")  # cuda:0 runs the first half, the CPU the rest
    device_map = {name: "cuda:0" if i < cut else "cpu" for i, name in enumerate(names)}
    plan = plan_shards(unet, strategy="explicit", device_map=device_map)
    with ModelShard(unet, plan) as shard:
        out = shard(inputs.sample, inputs.timestep, inputs.context, **inputs.conditioning)
        for block in layout_of(unet).blocks:
            for path in block.modules:
                for name, p in unet.get_submodule(path).named_parameters():
                    assert str(p.device) == plan.device_of(block.name), f"{path}.{name}"
        memory = shard.memory()
        assert memory["cuda:0"].allocated and memory["cuda:0"].total
    assert out.device == torch.device("cuda:0")
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=0)
