"""Tiny denoisers built from config under fixed seeds, and the inputs and splits the engine tests
run them with."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)

from server.engine import (
    ParallelPlan,
    plan_shards,
)
from server.engine.denoisers.blocks import DenoiserInputs
from server.pipeline import Pipeline
from server.pipeline.families import meta_denoiser
from server.requests import GenerationRequest
from server.requests.step_cache import StepCache
from tests.support.tiny_pipelines import _flux_transformer, _sd3_transformer


def tiny_sd3_transformer() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return _sd3_transformer().eval()


def tiny_flux_transformer(guidance: bool = True) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return _flux_transformer(guidance).eval()


def split_lone(folder: Path, request: list, prepare=lambda pipeline: pipeline, splits: bool = True, **load):
    """`request` alone on two CPU replicas whose plan splits lone requests (or not: `splits`;
    `prepare` adds what the pipeline serves; `load`: more of `Pipeline.load`'s options): its
    image, each worker's busy seconds and the loop's stats."""
    from server.pipeline.loading.folder import read_family
    from server.serving import Service

    one = plan_shards(meta_denoiser(read_family(folder)), "cpu", "memory")
    plan = ParallelPlan((one, one), 1, 1, workers=("cpu:0", "cpu:1"), splits_lone=splits)
    service = Service(prepare(Pipeline.load(folder, plan=plan, **load)), "tiny")
    try:
        image = service.submit(request).future.result(timeout=60)[0]
        return image, service.busy()["busy_seconds"], service.stats()
    finally:
        service.close()


def sequence_lane(folder: Path, degree: int = 2, **load) -> Pipeline:
    """A lane of `degree` CPU workers splitting every call's tokens (a sequence group; `load`:
    more of `Pipeline.load`'s options)."""
    from server.pipeline.loading.folder import read_family

    one = plan_shards(meta_denoiser(read_family(folder)), "cpu", "memory")
    workers = tuple(f"cpu:{i}" for i in range(degree))
    split = {"splits_lone": True, "sequence": degree, "grouped": True}
    plan = ParallelPlan((one,) * degree, 1, 1, workers=workers, **split)
    return Pipeline.load(folder, plan=plan, **load).lanes()[0]


def tiny_transformers() -> dict[str, tuple[torch.nn.Module, DenoiserInputs]]:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    flux = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=[4, 4, 8],
    ).eval()
    sd3 = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=32,
        out_channels=4,
    ).eval()
    steps = torch.tensor([900.0, 500.0])
    return {
        "flux": (
            flux,
            DenoiserInputs(
                torch.randn(2, 4, 14, 12),
                steps,
                torch.randn(2, 13, 32),
                {"pooled_projections": torch.randn(2, 32), "guidance": torch.full((2,), 3.5)},
            ),
        ),
        "sd3": (
            sd3,
            DenoiserInputs(
                torch.randn(2, 4, 16, 12),
                steps,
                torch.randn(2, 77, 32),
                {"pooled_projections": torch.randn(2, 32)},
            ),
        ),
    }


def as_request(body: dict) -> GenerationRequest:
    cache = body.get("step_cache")
    return GenerationRequest(
        body["prompt"],
        negative_prompt=body.get("negative_prompt"),
        seed=body["seed"],
        steps=body["num_inference_steps"],
        guidance_scale=body["guidance_scale"],
        width=32,
        height=32,
        step_cache=StepCache(cache["policy"], threshold=cache["threshold"]) if cache else None,
    )


def tiny_wan() -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()


def video_inputs() -> DenoiserInputs:
    """Two videos of 3 latent frames, 8×12 latents (72 tokens each), each at its own timestep."""
    generator = torch.Generator().manual_seed(1)
    return DenoiserInputs(
        torch.randn(2, 16, 3, 8, 12, generator=generator),
        torch.tensor([900.0, 400.0]),
        torch.randn(2, 7, 32, generator=generator),
    )
