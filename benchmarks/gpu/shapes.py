"""What the GPU check measures: published denoisers at the sizes people serve them, each with a
tiny twin for the CPU dry run, and how each is built with random weights on the device.

A model is built on the meta device from its published config, given storage on the device
(`to_empty`) and filled there: never a weight on the CPU, never a file.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
from diffusers import (
    Flux2Transformer2DModel,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)
from torch import nn

from server.engine import spec_for
from server.engine.denoisers.blocks import DenoiserInputs
from server.pipeline.families.flux import Flux
from server.pipeline.families.flux2 import Flux2
from server.pipeline.families.qwenimage import QwenImage
from server.pipeline.families.sdxl import SDXL
from server.pipeline.families.wan import WAN22_TI2V_5B, WAN_1_3B, Wan
from server.pipeline.families.zimage import ZImage

GiB = 2**30
FULL = frozenset({"lone_step", "batching", "step_cache", "memory", "quantized"})
# a lone step, its rows/s and memory: for the largest, where each call is seconds and the lease short
LIGHT = frozenset({"lone_step", "batching", "memory"})


@dataclass(frozen=True)
class Shape:
    """A published denoiser at a size people serve it, and a tiny twin for the CPU dry run."""

    cls: type[nn.Module]
    config: dict[str, Any]
    latent: tuple[int, ...]  # (h, w) or Wan's (frames, h, w)
    rows: tuple[int, ...]  # the batching sweep
    lone: int  # a lone request's rows
    keep_precise: tuple[str, ...]
    what: str
    measures: frozenset[str] = FULL
    free_gib: float = 0  # the device's free memory it needs: skipped (and said so) on smaller cards


SHAPES = {
    "sdxl": Shape(
        UNet2DConditionModel,
        SDXL.reference_configs["sdxl"],
        latent=(128, 128),
        rows=(1, 4, 8, 16),
        lone=2,
        keep_precise=(),
        what="SDXL's UNet (2.6 B) at 1024x1024, guided",
    ),
    "flux": Shape(
        FluxTransformer2DModel,
        Flux.reference_configs["flux-dev"],
        latent=(128, 128),
        rows=(1, 4, 8, 16),
        lone=1,
        keep_precise=Flux.keep_precise,
        what="FLUX.1-dev's transformer (11.9 B) at 1024x1024",
    ),
    "wan": Shape(
        WanTransformer3DModel,
        WAN_1_3B,
        latent=(21, 60, 104),
        rows=(1, 2, 4),
        lone=2,
        keep_precise=Wan.keep_precise,
        what="Wan 2.1 1.3B's transformer at 832x480, 81 frames, guided (rows of 32760 tokens: 4 at most)",
    ),
    # 1328² is the model card's square size: 166 latents a side, 83² = 6889 tokens a row
    "qwen": Shape(
        QwenImageTransformer2DModel,
        {},
        latent=(166, 166),
        rows=(2, 4),
        lone=2,
        keep_precise=QwenImage.keep_precise,
        what="Qwen-Image's transformer (20 B) at 1328x1328, guided",
        measures=LIGHT,
    ),
    "zimage": Shape(
        ZImageTransformer2DModel,
        {"axes_lens": [1536, 512, 512]},
        latent=(128, 128),
        rows=(1, 4, 8),
        lone=1,
        keep_precise=ZImage.keep_precise,
        what="Z-Image-Turbo's transformer (6 B) at 1024x1024",
        measures=LIGHT,
    ),
    # 32 B parameters: 64 GiB in bfloat16 (an H200 or an 80 GiB card's, barely)
    "flux2": Shape(
        Flux2Transformer2DModel,
        {},
        latent=(64, 64),
        rows=(1, 2),
        lone=1,
        keep_precise=Flux2.keep_precise,
        what="FLUX.2-dev's transformer (32 B) at 1024x1024",
        measures=LIGHT,
        free_gib=80,
    ),
    # the Wan 2.2 VAE's 16x: 1280x704x121 is 31 x 44 x 80 latents, 27280 tokens a row
    "wan22-5b": Shape(
        WanTransformer3DModel,
        WAN22_TI2V_5B,
        latent=(31, 44, 80),
        rows=(2,),
        lone=2,
        keep_precise=Wan.keep_precise,
        what="Wan 2.2 TI2V-5B's transformer at 1280x704, 121 frames, guided",
        measures=LIGHT,
    ),
    # one of A14B's two experts (Wan 2.1 14B's shape): 21 x 90 x 160 latents, 75600 tokens a row
    "wan22-a14b": Shape(
        WanTransformer3DModel,
        {},
        latent=(21, 90, 160),
        rows=(2,),
        lone=2,
        keep_precise=Wan.keep_precise,
        what="one Wan 2.2 A14B expert (14 B) at 1280x720, 81 frames, guided",
        measures=LIGHT,
    ),
}
# the dry run's: shaped like the tests' tiny models (tests/conftest.py, tests/support/tiny_*.py)
TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
TINY = {
    "sdxl": Shape(
        UNet2DConditionModel,
        dict(
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1,
            transformer_layers_per_block=(1, 2),
            cross_attention_dim=32,
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=32 + 6 * 8,
        ),
        latent=(16, 16),
        rows=(1, 2),
        lone=2,
        keep_precise=(),
        what="a tiny SDXL-shaped UNet",
    ),
    "flux": Shape(
        FluxTransformer2DModel,
        dict(
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=[4, 4, 8],
        ),
        latent=(16, 16),
        rows=(1, 2),
        lone=1,
        keep_precise=Flux.keep_precise,
        what="a tiny FLUX.1-shaped transformer",
    ),
    "wan": Shape(
        WanTransformer3DModel,
        TINY_WAN,
        latent=(3, 8, 12),
        rows=(1, 2),
        lone=2,
        keep_precise=Wan.keep_precise,
        what="a tiny Wan 2.1-shaped transformer",
    ),
    "qwen": Shape(
        QwenImageTransformer2DModel,
        dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(8, 4, 4),
        ),
        latent=(16, 16),
        rows=(2,),
        lone=2,
        keep_precise=QwenImage.keep_precise,
        what="a tiny Qwen-Image-shaped transformer",
        measures=LIGHT,
    ),
    "zimage": Shape(
        ZImageTransformer2DModel,
        dict(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=32,
            n_layers=2,
            n_refiner_layers=2,
            n_heads=2,
            n_kv_heads=2,
            qk_norm=True,
            cap_feat_dim=32,
            axes_dims=[8, 4, 4],
            axes_lens=[1536, 512, 512],
        ),
        latent=(16, 16),
        rows=(1, 2),
        lone=1,
        keep_precise=ZImage.keep_precise,
        what="a tiny Z-Image-shaped transformer",
        measures=LIGHT,
    ),
    "flux2": Shape(
        Flux2Transformer2DModel,
        dict(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=48,
            timestep_guidance_channels=256,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=True,
        ),
        latent=(8, 8),
        rows=(1, 2),
        lone=1,
        keep_precise=Flux2.keep_precise,
        what="a tiny FLUX.2-shaped transformer",
        measures=LIGHT,
    ),
    "wan22-5b": Shape(
        WanTransformer3DModel,
        {**TINY_WAN, "in_channels": 48, "out_channels": 48},
        latent=(3, 8, 12),
        rows=(2,),
        lone=2,
        keep_precise=Wan.keep_precise,
        what="a tiny Wan 2.2 TI2V-5B-shaped transformer",
        measures=LIGHT,
    ),
    "wan22-a14b": Shape(
        WanTransformer3DModel,
        TINY_WAN,
        latent=(3, 8, 12),
        rows=(2,),
        lone=2,
        keep_precise=Wan.keep_precise,
        what="a tiny Wan 2.1 14B-shaped expert",
        measures=LIGHT,
    ),
}
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def build_on_device(shape: Shape, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model from its config on `meta`, given storage on `device` and filled there: weights
    N(0, 0.02), norms 1 and biases 0; diffusers' `_keep_in_fp32_modules` in float32, as its
    loader keeps them. Tensors computed at construction (Wan's rotary buffers, Qwen-Image's
    rotary tables kept as plain attributes) are made again on `device` by the module's own
    constructor, from the arguments it keeps as attributes."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Module.to(shape.cls(**shape.config), dtype)  # diffusers' .to warns of fp32 parts
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, module in model.named_modules():
        if any(part in keep for part in name.split(".")):
            module.to(torch.float32)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, NORMS) or name == "bias":
                    param.fill_(1.0 if name == "weight" and isinstance(module, NORMS) else 0.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            if _computed(child):
                setattr(parent, child_name, _rebuilt(child, device))
    return model.eval()


def _computed(module: nn.Module) -> bool:
    """Whether `module` holds tensors its constructor computed: buffers, or plain attributes."""
    plain = any(isinstance(value, torch.Tensor) for value in vars(module).values())
    return plain or any(True for _ in module.buffers(recurse=False))


def _rebuilt(module: nn.Module, device: torch.device) -> nn.Module:
    signature = inspect.signature(type(module).__init__)
    kwargs = {}
    for name, param in list(signature.parameters.items())[1:]:
        if hasattr(module, name):
            kwargs[name] = getattr(module, name)
        elif param.default is inspect.Parameter.empty:
            raise ValueError(f"cannot rebuild {type(module).__name__}'s buffers: it keeps no {name!r}")
    with torch.device(device):
        return type(module)(**kwargs)


def inputs_for(
    model: nn.Module, shape: Shape, rows: int, dtype: torch.dtype, device: torch.device
) -> DenoiserInputs:
    spec = spec_for(model)
    inputs = spec.example_inputs(model, rows, shape.latent[-1], dtype, device)
    if len(shape.latent) == 3:  # a video: (frames, h, w), not square
        sample = torch.randn(rows, model.config.in_channels, *shape.latent, dtype=dtype, device=device)
        inputs = replace(inputs, sample=sample)
    elif shape.latent[0] != shape.latent[1]:
        raise ValueError(f"{shape.what}: an image's latent is square here, not {shape.latent}")
    return inputs


def free_gib(device: torch.device) -> float | None:
    """The device's free memory, or None on a CPU (whose memory the check does not plan)."""
    return torch.cuda.mem_get_info(device)[0] / GiB if device.type == "cuda" else None
