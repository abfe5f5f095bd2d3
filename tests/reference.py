"""The oracle every engine path is checked against: a denoiser's own diffusers forward, called
as its pipeline calls it (the block walker must give the same output)."""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel
from torch import nn

from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.denoisers.flux import image_ids, pack, unpack


def diffusers_forward(model: nn.Module, inputs: DenoiserInputs) -> torch.Tensor:
    """`model(...)` on `inputs`: UNet2DConditionModel, SD3Transformer2DModel or
    WanTransformer3DModel (a scalar timestep broadcast as the pipeline's `t.expand(batch)`) or
    FluxTransformer2DModel (latents packed, position ids made and the timestep scaled as
    FluxPipeline does)."""
    sample, context, cond = inputs.sample, inputs.context, inputs.conditioning
    with torch.inference_mode():
        if isinstance(model, FluxTransformer2DModel):
            b, _, h, w = sample.shape
            timestep = torch.as_tensor(inputs.timestep, device=sample.device).expand(b)
            out = model(
                hidden_states=pack(sample),
                timestep=timestep.to(sample.dtype) / 1000,
                encoder_hidden_states=context,
                txt_ids=torch.zeros(context.shape[1], 3, device=sample.device, dtype=sample.dtype),
                img_ids=image_ids(h, w, sample.device, sample.dtype),
                return_dict=False,
                **cond,
            )[0]
            return unpack(out, h, w)
        if isinstance(model, SD3Transformer2DModel | WanTransformer3DModel):  # a timestep a row
            timestep = torch.as_tensor(inputs.timestep, device=sample.device).expand(sample.shape[0])
            return model(
                hidden_states=sample,
                timestep=timestep,
                encoder_hidden_states=context,
                return_dict=False,
                **cond,
            )[0]
        return model(sample, inputs.timestep, encoder_hidden_states=context, return_dict=False, **cond)[0]
