"""Blocks in execution order and the skip edges between them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from server.engine import layout_of
from server.engine.denoisers.blocks import SkipEdge
from server.engine.planning.flow import trace_flow
from server.pipeline.families import meta_denoiser, reference_family
from tests.conftest import tiny_sd15_unet, tiny_sdxl_unet


def test_mid_block_runs_before_up_blocks_unlike_registration_order() -> None:
    unet = tiny_sd15_unet()
    children = [name for name, _ in unet.named_children()]
    assert children.index("up_blocks") < children.index("mid_block")  # what accelerate follows
    assert layout_of(unet).names == (
        "embed",
        "conv_in",
        "down_blocks.0",
        "down_blocks.1",
        "down_blocks.2",
        "mid_block",
        "up_blocks.0",
        "up_blocks.1",
        "up_blocks.2",
        "out",
    )


def test_sd15_skip_edges() -> None:
    # 10 residuals: conv_in 1, down0 3 (2 resnets + downsampler), down1 3, down2 2 (no
    # downsampler); each of the 3 up blocks pops 3, nearest producer first.
    assert layout_of(tiny_sd15_unet()).skips == (
        SkipEdge("down_blocks.2", "up_blocks.0", 2),
        SkipEdge("down_blocks.1", "up_blocks.0", 1),
        SkipEdge("down_blocks.1", "up_blocks.1", 2),
        SkipEdge("down_blocks.0", "up_blocks.1", 1),
        SkipEdge("down_blocks.0", "up_blocks.2", 2),
        SkipEdge("conv_in", "up_blocks.2", 1),
    )


def test_sdxl_embed_block_owns_the_added_embeddings() -> None:
    embed = layout_of(tiny_sdxl_unet()).blocks[0]
    assert embed.name == "embed"
    assert {"time_proj", "time_embedding", "add_time_proj", "add_embedding"} <= set(embed.modules)


@pytest.mark.parametrize("name", ["sd15", "sd21", "sdxl"])
def test_full_size_layouts_cover_every_parameter(name: str) -> None:
    layout = layout_of(
        meta_denoiser(reference_family(name))
    )  # raises if a parameter is in no block or in two
    assert layout.names[0] == "embed" and layout.names[-1] == "out"
    assert sum(edge.count for edge in layout.skips) == (12 if name != "sdxl" else 9)


def test_declared_skips_match_the_traced_data_flow(tiny_unet: nn.Module) -> None:
    """The residuals each up block reads, as a meta trace sees them, are the declared ones."""
    flow = trace_flow(tiny_unet, batch=2, latent_size=16, dtype=torch.float32)
    traced: dict[tuple[str, str], int] = {}
    for t in flow.tensors:
        if t.producer.startswith(("conv_in", "down_blocks")):
            for reader in t.consumers:
                if reader.startswith("up_blocks"):
                    traced[(t.producer, reader)] = traced.get((t.producer, reader), 0) + 1
    assert traced == {(e.source, e.target): e.count for e in layout_of(tiny_unet).skips}


def test_unknown_denoiser_is_refused_with_its_name() -> None:
    with pytest.raises(TypeError, match="no block layout for Linear"):
        layout_of(nn.Linear(2, 2))
