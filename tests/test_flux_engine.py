"""FLUX.1's transformer as blocks: layout, packing, sharded output, what crosses a boundary, a
full-size plan on the meta device."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel

from server.engine import ModelShard, layout_of, plan_shards, spec_for
from server.engine.denoisers.blocks import tensor_bytes
from server.engine.denoisers.flux import NATIVE_LATENT, T5_TOKENS, pack, unpack
from server.engine.denoisers.specs import native_latent
from server.engine.planning.flow import trace_flow
from tests.support.denoisers import tiny_flux_transformer
from tests.support.reference import diffusers_forward


def test_layout_is_the_embeddings_then_double_then_single_stream_blocks_then_the_output_head() -> None:
    model = tiny_flux_transformer()
    layout = layout_of(model)  # raises if a parameter or buffer is in no block or in two
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    assert layout.names == (
        "embed",
        *(f"transformer_blocks.{i}" for i in range(double)),
        *(f"single_transformer_blocks.{i}" for i in range(single)),
        "out",
    )
    assert layout.blocks[0].modules == ("x_embedder", "time_text_embed", "context_embedder", "pos_embed")
    assert layout.blocks[-1].modules == ("norm_out", "proj_out")
    assert layout.skips == ()
    owned = sum(tensor_bytes(model.get_submodule(p)) for b in layout.blocks for p in b.modules)
    assert owned == tensor_bytes(model)
    assert native_latent(model) == NATIVE_LATENT  # FLUX's config has no sample_size


def test_packing_is_2x2_patches_and_unpacking_undoes_it() -> None:
    latents = torch.arange(2 * 16 * 4 * 6, dtype=torch.float32).reshape(2, 16, 4, 6)
    tokens = pack(latents)
    assert tokens.shape == (2, 2 * 3, 64)
    assert torch.equal(tokens[0, 0, :4], latents[0, 0, :2, :2].flatten())  # a channel's patch, row-major
    assert torch.equal(unpack(tokens, 4, 6), latents)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_sharded_on_two_and_three_cpus_equals_unsharded(guidance: bool) -> None:
    model = tiny_flux_transformer(guidance)
    spec = spec_for(model)
    inputs = spec.example_inputs(model, 3, 8, torch.float32, torch.device("cpu"))
    assert inputs.sample.shape == (3, 16, 8, 8) and inputs.context.shape[1] == T5_TOKENS
    assert ("guidance" in inputs.conditioning) == guidance
    with torch.inference_mode():
        expected = diffusers_forward(model, inputs)
    for devices in ("cpu,cpu", "cpu,cpu,cpu"):
        plan = plan_shards(model, devices, "even")
        assert len(plan.stages) == len(devices.split(","))
        shard = ModelShard(model, plan)
        out = shard(inputs.sample, inputs.timestep, inputs.context, **inputs.conditioning)
        assert torch.equal(out, expected)


def test_both_streams_temb_and_the_rotary_embedding_cross_every_boundary_between_blocks() -> None:
    model = tiny_flux_transformer()
    flow = trace_flow(model, batch=2, latent_size=8, dtype=torch.float32)
    names = layout_of(model).names
    for cut in range(1, len(names) - 1):
        assert len(flow.crossing(set(names[:cut]))) == 5, names[cut]  # image, text, temb, cos, sin
    assert len(flow.crossing(set(names[:-1]))) == 2  # the output head takes the image stream and temb


def test_flux1_plans_on_the_meta_device_with_its_boundary_bytes() -> None:
    with torch.device("meta"):
        model = FluxTransformer2DModel()  # diffusers' defaults are FLUX.1-dev's transformer
    plan = plan_shards(model, "cpu,cpu", "even", dtype=torch.bfloat16, latent_size=NATIVE_LATENT)
    assert plan.blocks[0] == "embed" and plan.blocks[-1] == "out" and len(plan.blocks) == 1 + 19 + 38 + 1
    # batch 2 at 128² latents: 64² image tokens and 512 text tokens of 3072 in bf16, temb; the
    # rotary cos and sin in float32, [tokens, 128] each, shared by the batch
    tokens = 64 * 64 + T5_TOKENS
    assert plan.boundaries[0].bytes == 2 * 2 * (tokens + 1) * 3072 + 2 * tokens * 128 * 4
