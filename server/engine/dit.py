"""Stable Diffusion 3's MMDiT (`diffusers.SD3Transformer2DModel`) as blocks.

forward runs three embeddings first: `pos_embed` patchifies the latent and adds the
(cropped) sin-cos positions, `time_text_embed` turns the timestep and the pooled CLIP
projections into `temb`, `context_embedder` projects the text context; an IP-Adapter's
`image_proj`, when one is loaded, runs there too. They form the `embed` block. Then each
`transformer_blocks.{i}` maps (image tokens, text tokens, temb) to the next pair: one block
each. `norm_out` (modulated by temb) and `proj_out` end it, then forward unpatchifies
outside any module. There are no skip residuals: only the two token streams and `temb`
cross a boundary, and `temb` crosses every one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.engine.blocks import Block, DenoiserInputs, Layout

CLIP_TOKENS = 77  # both CLIP encoders' hidden states, side by side in the channels
T5_TOKENS = 256  # StableDiffusion3Pipeline's default max_sequence_length; zeros without text_encoder_3


class SD3TransformerSpec:
    """`diffusers.SD3Transformer2DModel`: SD 3 and 3.5 (dual attention, qk norm) alike."""

    EMBEDDING = ("pos_embed", "time_text_embed", "context_embedder", "image_proj")
    OUTPUT = ("norm_out", "proj_out")

    def layout(self, model: nn.Module) -> Layout:
        def present(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(n for n in names if getattr(model, n, None) is not None)

        blocks = [Block("embed", present(self.EMBEDDING))]
        blocks += [
            Block(f"transformer_blocks.{i}", (f"transformer_blocks.{i}",))
            for i in range(len(model.transformer_blocks))
        ]
        blocks.append(Block("out", present(self.OUTPUT)))
        return Layout(tuple(blocks))

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        size = (batch, config.in_channels, latent_size, latent_size)
        sample = torch.randn(size, dtype=dtype, device=device)
        # Flow-matching timesteps are sigma·1000, float32 as the scheduler makes them; one per row.
        timestep = torch.linspace(1000.0, 1.0, batch, device=device)
        tokens = CLIP_TOKENS + T5_TOKENS
        context = torch.randn(batch, tokens, config.joint_attention_dim, dtype=dtype, device=device)
        pooled = torch.randn(batch, config.pooled_projection_dim, dtype=dtype, device=device)
        conditioning: dict[str, Any] = {"pooled_projections": pooled}
        return DenoiserInputs(sample, timestep, context, conditioning)

    def forward(self, model: nn.Module, inputs: DenoiserInputs) -> torch.Tensor:
        # The timestep embedding wants a [B] tensor (the UNet also takes a scalar): broadcast
        # a scalar as the pipeline does with `t.expand(batch)`.
        timestep = torch.as_tensor(inputs.timestep, device=inputs.sample.device)
        if timestep.ndim == 0:
            timestep = timestep.expand(inputs.sample.shape[0])
        return model(
            hidden_states=inputs.sample,
            timestep=timestep,
            encoder_hidden_states=inputs.context,
            return_dict=False,
            **inputs.conditioning,
        )[0]
