"""`diffusers.UNet2DConditionModel` as blocks: time embedding, conv_in, down blocks, mid block,
up blocks, out, with the skip residuals each up block takes from the down path."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.engine.blocks import Block, DenoiserInputs, Layout, SkipEdge


class UNetSpec:
    """`diffusers.UNet2DConditionModel`, with or without added conditioning (`added_cond_kwargs`)."""

    # Modules forward runs before conv_in: timestep, class, added and context embeddings.
    EMBEDDING = (
        "time_proj",
        "time_embedding",
        "class_embedding",
        "add_time_proj",
        "add_embedding",
        "time_embed_act",
        "encoder_hid_proj",
        "position_net",
    )
    OUTPUT = ("conv_norm_out", "conv_act", "conv_out")

    def layout(self, model: nn.Module) -> Layout:
        def present(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(n for n in names if getattr(model, n, None) is not None)

        blocks = [Block("embed", present(self.EMBEDDING)), Block("conv_in", ("conv_in",))]
        blocks += [Block(f"down_blocks.{i}", (f"down_blocks.{i}",)) for i in range(len(model.down_blocks))]
        if model.mid_block is not None:
            blocks.append(Block("mid_block", ("mid_block",)))
        blocks += [Block(f"up_blocks.{i}", (f"up_blocks.{i}",)) for i in range(len(model.up_blocks))]
        blocks.append(Block("out", present(self.OUTPUT)))
        return Layout(tuple(blocks), unet_skips(model))

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        if not isinstance(config.cross_attention_dim, int):
            raise ValueError("per-block cross_attention_dim is not supported")
        sample = torch.randn(batch, config.in_channels, latent_size, latent_size, dtype=dtype, device=device)
        timestep = torch.arange(batch, device=device) * 7 + 1  # distinct per-sample timesteps
        context = torch.randn(batch, 77, config.cross_attention_dim, dtype=dtype, device=device)
        conditioning: dict[str, Any] = {}
        if config.addition_embed_type == "text_time":  # pooled text embeds + 6 size/crop ids
            text_dim = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            conditioning["added_cond_kwargs"] = {
                "text_embeds": torch.randn(batch, text_dim, dtype=dtype, device=device),
                "time_ids": torch.randn(batch, 6, dtype=dtype, device=device),
            }
        return DenoiserInputs(sample, timestep, context, conditioning)

    def forward(self, model: nn.Module, inputs: DenoiserInputs) -> torch.Tensor:
        return model(
            inputs.sample,
            inputs.timestep,
            encoder_hidden_states=inputs.context,
            return_dict=False,
            **inputs.conditioning,
        )[0]


def unet_skips(model: nn.Module) -> tuple[SkipEdge, ...]:
    """Which block made each residual an up block consumes.

    forward stacks conv_in's output, then every down block's per-resnet (and downsampler)
    outputs; each up block pops `len(resnets)` residuals off the top of that stack.
    """
    stack = ["conv_in"]
    for i, block in enumerate(model.down_blocks):
        made = len(block.resnets) + (1 if block.downsamplers is not None else 0)
        stack += [f"down_blocks.{i}"] * made
    edges: list[SkipEdge] = []
    for i, block in enumerate(model.up_blocks):
        want = len(block.resnets)
        if want > len(stack):
            raise ValueError(f"up_blocks.{i} consumes {want} residuals but only {len(stack)} remain")
        taken, stack = stack[-want:], stack[:-want]
        for source in dict.fromkeys(reversed(taken)):  # nearest producer first, as forward pops
            edges.append(SkipEdge(source, f"up_blocks.{i}", taken.count(source)))
    if stack:
        raise ValueError(f"{len(stack)} residuals are never consumed by an up block")
    return tuple(edges)
