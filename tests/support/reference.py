"""The oracle every engine path is checked against: a denoiser's own diffusers forward, called
as its pipeline calls it (the block walker must give the same output)."""

from __future__ import annotations

import torch
from diffusers import (
    Flux2Transformer2DModel,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)
from torch import nn

from server.engine.denoisers.blocks import TEXT_MASK, DenoiserInputs
from server.engine.denoisers.flux import image_ids, pack, unpack
from server.engine.denoisers.flux2 import image_ids as flux2_image_ids
from server.engine.denoisers.flux2 import text_ids as flux2_text_ids


def diffusers_forward(model: nn.Module, inputs: DenoiserInputs) -> torch.Tensor:
    """`model(...)` on `inputs`, as the model's pipeline calls it: UNet2DConditionModel,
    SD3Transformer2DModel or WanTransformer3DModel (a scalar timestep broadcast as the pipeline's
    `t.expand(batch)`); FluxTransformer2DModel (latents packed, position ids made and the timestep
    scaled as FluxPipeline does); QwenImageTransformer2DModel, Flux2Transformer2DModel and
    ZImageTransformer2DModel as theirs do (`_flow_forward`)."""
    sample, context, cond = inputs.sample, inputs.context, inputs.conditioning
    with torch.inference_mode():
        if isinstance(
            model, QwenImageTransformer2DModel | Flux2Transformer2DModel | ZImageTransformer2DModel
        ):
            return _flow_forward(model, inputs)
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


def _flow_forward(model: nn.Module, inputs: DenoiserInputs) -> torch.Tensor:
    """QwenImagePipeline's, Flux2Pipeline's and ZImagePipeline's transformer call on [b, c, h, w]
    latents (a timestep a row, as sigma · 1000), back in that layout."""
    sample, context, cond = inputs.sample, inputs.context, inputs.conditioning
    b, c, h, w = sample.shape
    timestep = torch.as_tensor(inputs.timestep, device=sample.device).expand(b)
    if isinstance(model, ZImageTransformer2DModel):  # a list of [c, 1, h, w] frames; −its output
        mask = cond.get(TEXT_MASK)
        captions = [row if mask is None else row[m.bool()] for row, m in zip(context, mask, strict=False)]
        t = (1000 - timestep.float()) / 1000
        out = model(list(sample.unsqueeze(2).unbind(0)), t, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)
    if isinstance(model, QwenImageTransformer2DModel):
        out = model(
            hidden_states=pack(sample),
            timestep=timestep.to(sample.dtype) / 1000,
            encoder_hidden_states=context,
            encoder_hidden_states_mask=cond.get(TEXT_MASK),
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack(out, h, w)
    out = model(
        hidden_states=sample.reshape(b, c, h * w).permute(0, 2, 1),
        timestep=timestep.to(sample.dtype) / 1000,
        encoder_hidden_states=context,
        txt_ids=flux2_text_ids(context.shape[1], sample.device).expand(b, -1, -1),
        img_ids=flux2_image_ids(h, w, sample.device).expand(b, -1, -1),
        return_dict=False,
        **cond,
    )[0]
    return out.permute(0, 2, 1).reshape(b, c, h, w)
