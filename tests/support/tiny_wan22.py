"""Tiny Wan 2.2 folders for issue 51, with random weights, built from config under fixed seeds and
saved as diffusers saves any pipeline (safetensors), offline (the UMT5 encoder and its tokenizer
are `tests/support/tiny_pipelines.py`'s, as its Wan 2.1 folders have them).

- `build_wan22_two_expert_folder`: Wan2.2-T2V-A14B's shape (`WanPipeline`): a high-noise expert
  `transformer` and a low-noise expert `transformer_2` of one config with different weights, and
  `boundary_ratio` 0.875 in model_index (diffusers' scripts/convert_wan_to_diffusers.py): the
  pipeline runs `transformer` while t >= 0.875 * 1000, then `transformer_2` (with
  `guidance_scale_2`).
- `build_wan22_i2v_two_expert_folder`: Wan2.2-I2V-A14B's shape (`WanImageToVideoPipeline`): two
  36-channel experts, no image encoder, `boundary_ratio` 0.9.
- `build_wan22_ti2v_folder`: Wan2.2-TI2V-5B's shape (`WanPipeline` with `expand_timesteps`): one
  48-channel transformer and the Wan 2.2 VAE (z_dim 48, 2×2 pixel patches in (12 channels),
  residual blocks, 16× spatial and 4× temporal). Text-to-video runs with `WanPipeline`; its
  image-to-video runs the same folder with `WanImageToVideoPipeline` (no image encoder: the
  image's latents replace the first latent frame, whose tokens take timestep 0).

`wan_video` is the reference the tests hold a folder's videos to: the diffusers pipeline's frames.

Each holds the scheduler its published folder ships: UniPCMultistepScheduler (flow_prediction,
flow sigmas, flow_shift 3.0 for A14B, 5.0 for TI2V-5B; `tiny_pipelines.wan_scheduler`).

Run `python -m tests.support.tiny_wan22` (offline: HF_HUB_OFFLINE=1) to build both in a temporary folder
and run each pipeline on them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

from tests.support.tiny_pipelines import _wan_parts, wan_scheduler

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from server.requests import GenerationRequest

BOUNDARY_RATIO_T2V = 0.875  # Wan2.2-T2V-A14B (WanPipeline)
BOUNDARY_RATIO_I2V = 0.9  # Wan2.2-I2V-A14B (WanImageToVideoPipeline)
SHIFT_A14B = 3.0  # the published UniPC scheduler's flow_shift (A14B)
SHIFT_TI2V = 5.0  # TI2V-5B's
TI2V_SIZE = 64  # pixels: 4×4 latents (16× spatial), 2×2 tokens a latent frame

# The Wan 2.2 VAE's per-channel latent statistics (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json,
# as scripts/convert_wan_to_diffusers.py's vae22_diffusers_config writes them).
WAN22_LATENTS_MEAN = [
    -0.2289,
    -0.0052,
    -0.1323,
    -0.2339,
    -0.2799,
    0.0174,
    0.1838,
    0.1557,
    -0.1382,
    0.0542,
    0.2813,
    0.0891,
    0.1570,
    -0.0098,
    0.0375,
    -0.1825,
    -0.2246,
    -0.1207,
    -0.0698,
    0.5109,
    0.2665,
    -0.2108,
    -0.2158,
    0.2502,
    -0.2055,
    -0.0322,
    0.1109,
    0.1567,
    -0.0729,
    0.0899,
    -0.2799,
    -0.1230,
    -0.0313,
    -0.1649,
    0.0117,
    0.0723,
    -0.2839,
    -0.2083,
    -0.0520,
    0.3748,
    0.0152,
    0.1957,
    0.1433,
    -0.2944,
    0.3573,
    -0.0548,
    -0.1681,
    -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765,
    1.0364,
    0.4514,
    1.1677,
    0.5313,
    0.4990,
    0.4818,
    0.5013,
    0.8158,
    1.0344,
    0.5894,
    1.0901,
    0.6885,
    0.6165,
    0.8454,
    0.4978,
    0.5759,
    0.3523,
    0.7135,
    0.6804,
    0.5833,
    1.4146,
    0.8986,
    0.5659,
    0.7069,
    0.5338,
    0.4889,
    0.4917,
    0.4069,
    0.4999,
    0.6866,
    0.4093,
    0.5709,
    0.6065,
    0.6415,
    0.4944,
    0.5726,
    1.2042,
    0.5458,
    1.6887,
    0.3971,
    1.0600,
    0.3943,
    0.5537,
    0.5444,
    0.4089,
    0.7468,
    0.7744,
]


def wan22_vae() -> AutoencoderKLWan:
    """The Wan 2.2 VAE's shape at a 3-channel base (published: base_dim 160, decoder_base_dim 256,
    dim_mult [1, 2, 4, 4]): 2×2 pixel patches make 12 input channels (`patch_size`, `in_channels`,
    `out_channels`), three 2× downsamples make 16× in all (`scale_factor_spatial`, which the
    pipelines read), two temporal ones 4× (`temperal_downsample`), and residual down/up blocks
    (`is_residual`) make 48 latent channels (`z_dim`)."""
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=48,
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=WAN22_LATENTS_MEAN,
        latents_std=WAN22_LATENTS_STD,
    )


def build_wan22_two_expert_folder(folder: Path, **transformer: object) -> Path:
    """A tiny Wan2.2-T2V-A14B folder: `tiny_pipelines`' Wan 2.1 parts (a 2-block transformer over
    1×2×2 patches, the 16-channel Wan 2.1 VAE, UMT5; `transformer`: other sizes) with a second
    transformer of the same config drawn under another seed (`transformer_2`, the low-noise
    expert), `boundary_ratio` 0.875 and the published UniPC scheduler (flow_shift 3)."""
    parts = _wan_parts(**transformer)
    torch.manual_seed(1)
    low_noise = WanTransformer3DModel.from_config(parts["transformer"].config)
    parts["scheduler"] = wan_scheduler(SHIFT_A14B)
    pipe = WanPipeline(**parts, transformer_2=low_noise, boundary_ratio=BOUNDARY_RATIO_T2V)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def build_wan22_i2v_two_expert_folder(folder: Path) -> Path:
    """A tiny Wan2.2-I2V-A14B folder (`WanImageToVideoPipeline`): two experts taking 36 channels
    (noise, the first frame's mask and latents, as Wan 2.1 I2V's) with no image encoder nor
    `image_dim` (Wan 2.2 drops CLIP), and `boundary_ratio` 0.9."""
    from diffusers import WanImageToVideoPipeline

    parts = _wan_parts(in_channels=36)
    torch.manual_seed(2)
    low_noise = WanTransformer3DModel.from_config(parts["transformer"].config)
    parts["scheduler"] = wan_scheduler(SHIFT_A14B)
    pipe = WanImageToVideoPipeline(
        **parts,
        image_encoder=None,
        image_processor=None,
        transformer_2=low_noise,
        boundary_ratio=BOUNDARY_RATIO_I2V,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def build_wan22_ti2v_folder(folder: Path) -> Path:
    """A tiny Wan2.2-TI2V-5B folder: one transformer over 48 channels (published: 24 heads × 128,
    30 layers, ffn 14336), the 48-channel Wan 2.2 VAE (`wan22_vae`), UMT5, UniPC at flow_shift
    5, and `expand_timesteps` (a timestep per token) in model_index; saved as `WanPipeline`,
    as the published folder is (image-to-video loads it as `WanImageToVideoPipeline`)."""
    parts = _wan_parts(in_channels=48, out_channels=48)
    parts["vae"] = wan22_vae()
    parts["scheduler"] = wan_scheduler(SHIFT_TI2V)
    WanPipeline(**parts, expand_timesteps=True).save_pretrained(folder, safe_serialization=True)
    return folder


def wan_video(
    folder: Path,
    request: GenerationRequest,
    image: Image.Image | None = None,
    lora: tuple[Path, float] | None = None,
    tiled: bool = False,
) -> np.ndarray:
    """WanPipeline's (with `image`: WanImageToVideoPipeline's) frames, [frames, height, width, 3] in
    [0, 1], for a `GenerationRequest` whose prompts, size, frames, steps, scales and seed are set;
    with `lora` (a file, its scale) loaded as adapter "style" if given; `tiled`: decoded after
    `vae.enable_tiling()`."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    pipeline_wan_i2v.basic_clean = pipeline_wan.basic_clean  # its cleaning calls ftfy, not installed here
    cls = WanPipeline if image is None else WanImageToVideoPipeline
    pipe = cls.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora[0], adapter_name="style")
        pipe.set_adapters(["style"], [lora[1]])
    if tiled:
        pipe.vae.enable_tiling()
    return pipe(
        **({} if image is None else {"image": image}),
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        height=request.height,
        width=request.width,
        num_frames=request.frames,
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        guidance_scale_2=request.guidance_scale_2,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
    ).frames[0]


def _count_calls(model: torch.nn.Module | None, calls: list[str], name: str) -> None:
    if model is not None:
        model.register_forward_hook(lambda *_: calls.append(name))


def _report(name: str, frames: torch.Tensor, calls: list[str] | None = None) -> None:
    used = f", calls {calls}" if calls is not None else ""
    print(f"{name}: frames {tuple(frames.shape)}, std {frames.float().std():.4f}{used}")


def main() -> None:
    import tempfile

    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
    from PIL import Image

    # WanImageToVideoPipeline's prompt cleaning calls ftfy unguarded (not installed here): WanPipeline's
    # guards it, as tests/test_videos.py patches it too.
    pipeline_wan_i2v.basic_clean = pipeline_wan.basic_clean

    common: dict[str, Any] = dict(
        prompt="a red cat",
        negative_prompt="blurry",
        num_frames=9,
        num_inference_steps=4,
        max_sequence_length=16,
        output_type="pt",
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_wan22_two_expert_folder(Path(tmp) / "t2v_a14b")
        pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        assert pipe.config.boundary_ratio == BOUNDARY_RATIO_T2V and pipe.transformer_2 is not None
        first, second = pipe.transformer.state_dict(), pipe.transformer_2.state_dict()
        assert any(not torch.equal(first[k], second[k]) for k in first), "the experts share weights"
        calls: list[str] = []
        _count_calls(pipe.transformer, calls, "high")
        _count_calls(pipe.transformer_2, calls, "low")
        video = pipe(
            **common,
            height=32,
            width=32,
            guidance_scale=4.0,
            guidance_scale_2=3.0,
            generator=torch.Generator().manual_seed(0),
        ).frames
        _report("T2V-A14B two experts (WanPipeline)", video, calls)
        assert "high" in calls and "low" in calls

        folder = build_wan22_ti2v_folder(Path(tmp) / "ti2v_5b")
        pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        assert pipe.config.expand_timesteps and pipe.vae_scale_factor_spatial == 16
        size = dict(height=TI2V_SIZE, width=TI2V_SIZE, guidance_scale=5.0)
        video = pipe(**common, **size, generator=torch.Generator().manual_seed(0)).frames
        _report("TI2V-5B text-to-video (WanPipeline, expand_timesteps)", video)

        i2v = WanImageToVideoPipeline.from_pretrained(folder, local_files_only=True)
        i2v.set_progress_bar_config(disable=True)
        assert i2v.config.expand_timesteps and i2v.image_encoder is None
        image = Image.new("RGB", (TI2V_SIZE, TI2V_SIZE), (200, 40, 40))
        timesteps: list[torch.Tensor] = []
        i2v.transformer.register_forward_pre_hook(
            lambda _, args, kwargs: timesteps.append(kwargs["timestep"]), with_kwargs=True
        )
        video = i2v(**common, **size, image=image, generator=torch.Generator().manual_seed(0)).frames
        _report("TI2V-5B image-to-video (WanImageToVideoPipeline)", video)
        first = timesteps[0]  # [batch, tokens]: 0 on the first latent frame's 2×2 tokens, t after
        print(f"  per-token timestep {tuple(first.shape)}: {first[0].tolist()}")
        assert first.shape == (1, 3 * 2 * 2) and not first[0, :4].any() and first[0, 4:].gt(0).all()


if __name__ == "__main__":
    main()
