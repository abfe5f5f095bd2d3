"""Wan 2.x's video transformer in the engine (issue 41, first part): a tiny `WanTransformer3DModel`
(built from config, seed 0) as blocks equals diffusers' forward, unsplit, over two stages (its
root `scale_shift_table` placed with the last block) and as a sequence group of 2 and 3 ranks;
the planner counts every byte it holds."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from server.engine import CallPlan, ModelShard, layout_of, plan_shards
from server.engine.denoisers.blocks import DenoiserInputs, TensorPart, part, tensor_bytes
from server.engine.runtime.replicas import Workers, sharing_weights
from server.engine.runtime.sequence import run_sequence


def tiny_wan() -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=3, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()  # fmt: skip


def video_inputs() -> DenoiserInputs:
    """Two videos of 3 latent frames, 8×12 latents (72 tokens each), each at its own timestep."""
    generator = torch.Generator().manual_seed(1)
    return DenoiserInputs(
        torch.randn(2, 16, 3, 8, 12, generator=generator),
        torch.tensor([900.0, 400.0]),
        torch.randn(2, 7, 32, generator=generator),
    )


def diffusers_forward(model: WanTransformer3DModel, inputs: DenoiserInputs) -> torch.Tensor:
    with torch.inference_mode():
        return model(inputs.sample, inputs.timestep, inputs.context, return_dict=False)[0]


def test_the_layout_owns_every_tensor_once_the_root_table_with_the_output() -> None:
    model = tiny_wan()
    layout = layout_of(model)
    assert layout.names == ("embed", "blocks.0", "blocks.1", "blocks.2", "out")
    assert layout.blocks[-1].modules == ("norm_out", "proj_out", "scale_shift_table")
    table = part(model, "scale_shift_table")
    assert isinstance(table, TensorPart) and tensor_bytes(table) == model.scale_shift_table.numel() * 4
    table.to(torch.float64)  # a part moves (or casts) the model's own parameter, in place
    assert model.scale_shift_table.dtype == torch.float64
    plan = plan_shards(tiny_wan(), ["cpu"], "memory")
    assert sum(plan.stages[0].block_bytes) == tensor_bytes(model, torch.float32)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_our_blocks_equal_diffusers_forward(devices: list[str]) -> None:
    model, inputs = tiny_wan(), video_inputs()
    expected = diffusers_forward(model, inputs)
    shard = ModelShard(model, plan_shards(model, devices, "even"))
    assert len(shard.plan.stages) == len(devices) and shard.plan.stages[-1].blocks[-1] == "out"
    assert torch.equal(shard.run(inputs, CallPlan.plain(2)).out, expected)


@pytest.mark.parametrize("degree", [2, 3])  # 2 heads: Ulysses at 2, the keys and values gathered at 3
def test_a_video_split_over_a_sequence_group_equals_the_unsplit_call(degree: int) -> None:
    model, inputs = tiny_wan(), video_inputs()
    expected = diffusers_forward(model, inputs)
    shards = [ModelShard(model, plan_shards(model, ["cpu"], "memory"))]
    shards += [ModelShard(sharing_weights(model), shards[0].plan) for _ in range(degree - 1)]
    workers = Workers(degree - 1, 1)
    try:
        out = run_sequence(shards, shards[0].sequence, inputs, CallPlan.plain(2), workers.submit).out
    finally:
        workers.close()
    assert torch.allclose(out, expected, atol=1e-5), float((out - expected).abs().max())
