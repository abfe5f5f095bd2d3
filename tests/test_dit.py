"""Stable Diffusion 3's MMDiT as blocks: layout, sharded output, a full-size plan, the tiny folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from server.engine import ModelShard, layout_of, plan_shards, spec_for
from server.engine.denoisers.blocks import tensor_bytes
from server.engine.denoisers.dit import CLIP_TOKENS, T5_TOKENS
from server.engine.planning.flow import trace_flow
from server.pipeline.families import meta_denoiser, reference_family
from tests.support.denoisers import tiny_sd3_transformer
from tests.support.reference import diffusers_forward
from tests.support.tiny_pipelines import IMAGE_SIZE


def test_layout_is_the_embeddings_then_each_transformer_block_then_the_output_head() -> None:
    model = tiny_sd3_transformer()
    layout = layout_of(model)  # raises if a parameter or buffer is in no block or in two
    n = len(model.transformer_blocks)
    assert layout.names == ("embed", *(f"transformer_blocks.{i}" for i in range(n)), "out")
    assert layout.blocks[0].modules == ("pos_embed", "time_text_embed", "context_embedder")
    assert layout.blocks[-1].modules == ("norm_out", "proj_out")
    assert layout.skips == ()
    owned = sum(tensor_bytes(model.get_submodule(p)) for b in layout.blocks for p in b.modules)
    assert owned == tensor_bytes(model)  # the pos_embed buffer included


def test_example_inputs_look_like_the_pipelines_call() -> None:
    model = tiny_sd3_transformer()
    inputs = spec_for(model).example_inputs(model, 3, 16, torch.float32, torch.device("cpu"))
    assert inputs.sample.shape == (3, 16, 16, 16)
    assert len(set(inputs.timestep.tolist())) == 3
    assert inputs.context.shape == (3, CLIP_TOKENS + T5_TOKENS, model.config.joint_attention_dim)
    assert inputs.conditioning["pooled_projections"].shape == (3, model.config.pooled_projection_dim)


@pytest.mark.parametrize("strategy", ["even", "memory"])
def test_sharded_on_two_cpus_equals_unsharded(strategy: str) -> None:
    model = tiny_sd3_transformer()
    spec = spec_for(model)
    inputs = spec.example_inputs(model, 3, 16, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        expected = diffusers_forward(model, inputs)
    plan = plan_shards(model, "cpu,cpu", strategy)
    assert len(plan.stages) == 2
    shard = ModelShard(model, plan)
    out = shard(inputs.sample, inputs.timestep, inputs.context, **inputs.conditioning)
    assert torch.equal(out, expected)
    scalar = shard(inputs.sample, 500.0, inputs.context, **inputs.conditioning)
    with torch.inference_mode():
        same_t = torch.full((3,), 500.0)
        assert torch.equal(
            scalar,
            model(
                hidden_states=inputs.sample,
                timestep=same_t,
                encoder_hidden_states=inputs.context,
                pooled_projections=inputs.conditioning["pooled_projections"],
            ).sample,
        )


def test_only_the_two_token_streams_and_the_timestep_embedding_cross_a_boundary() -> None:
    model = tiny_sd3_transformer()
    flow = trace_flow(model, batch=2, latent_size=16, dtype=torch.float32)
    names = layout_of(model).names
    for cut in range(1, len(names) - 1):
        crossing = flow.crossing(set(names[:cut]))
        assert len(crossing) == 3, names[cut]  # image tokens, text tokens, temb
    # The last transformer block is context_pre_only: it returns no text tokens.
    assert len(flow.crossing(set(names[:-1]))) == 2


def test_sd3_medium_plans_on_the_meta_device_over_two_cpus() -> None:
    model = meta_denoiser(reference_family("sd3"))  # SD3-medium's transformer config
    plan = plan_shards(model, "cpu,cpu", "memory")
    blocks = [f"transformer_blocks.{i}" for i in range(24)]
    assert plan.blocks == ("embed", *blocks, "out")
    assert len(plan.stages) == 2 and all(len(s.blocks) > 8 for s in plan.stages)
    # batch 2 at 128²: 64² patches of 1536, 77 + 256 text tokens of 1536, one temb row each
    tokens, text, width = 64 * 64, CLIP_TOKENS + T5_TOKENS, 1536
    assert plan.boundaries[0].bytes == 4 * 2 * (tokens + text + 1) * width
    assert plan.boundaries[0].skips == ()


def test_tiny_sd3_folder_generates_an_unsaturated_image_offline(sd3_folder: Path) -> None:
    # The folder saves text_encoder_3 and tokenizer_3 as [null, null]: diffusers wants them passed.
    pipe = StableDiffusion3Pipeline.from_pretrained(
        sd3_folder, text_encoder_3=None, tokenizer_3=None, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        "a red circle",
        generator=torch.Generator("cpu").manual_seed(3),
        num_inference_steps=4,
        guidance_scale=4.0,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        output_type="np",
    ).images
    assert image.shape == (1, IMAGE_SIZE, IMAGE_SIZE, 3)
    assert np.mean((image > 0.01) & (image < 0.99)) > 0.9
    assert pipe.scheduler.config.shift == 3.0 and pipe.vae.config.shift_factor == 0.0609
