"""Tiny Stable Diffusion-family pipeline folders with random weights, built from config under
fixed seeds and saved as diffusers saves any pipeline (safetensors). Shapes follow the real
models: SD-1.5 (one CLIP encoder, cross-attention UNet) and SDXL (two encoders, pooled
projection, text_time added embeddings); sizes are a few thousand parameters per part."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    PNDMScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from server.demo.tokenizer import WORDS, build_tokenizer

TEXT_DIM = 32
IMAGE_SIZE = 32  # pixels; latents are 16x16 (the tiny VAE downsamples by 2)

# Stable Diffusion's published scheduler settings (epsilon prediction, "leading" spacing).
SD_SCHEDULE = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "steps_offset": 1,
    "clip_sample": False,
    "set_alpha_to_one": False,
}
# The schedulers the published folders ship, key for key as their scheduler_config.json says (a
# per-request scheduler is made from_config of it: e.g. its clip_sample false reaches DDIM):
# stable-diffusion-v1-5 (and its inpainting folder): PNDM, PLMS steps only
SD15_PNDM = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
    "clip_sample": False,
}
# stable-diffusion-xl-base-1.0: Euler, "leading" spacing, linear interpolation (and DDIM's keys)
SDXL_EULER = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "interpolation_type": "linear",
    "prediction_type": "epsilon",
    "use_karras_sigmas": False,
    "clip_sample": False,
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "trained_betas": None,
}


def _text_config(tokenizer, **extra) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


# A tiny SD-1.5 folder for 1024² images (build_sd15_folder(folder, **LARGE_SD15)): SD's 8x VAE in
# miniature (four blocks, SD-1.5's 512-pixel tile) makes them 128² latents, where the 2x VAE's 512²
# would take the UNet's attention minutes; self-attention only at the UNet's lower level keeps a
# step under a second (at 128² tokens its top-level attention alone takes seconds).
LARGE_SD15 = {
    "vae": {"block_out_channels": (8, 16, 16, 16), "norm_num_groups": 4, "sample_size": 512},
    "unet": {
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    },
}


def _vae(**shape) -> AutoencoderKL:
    blocks = len(shape.get("block_out_channels", (16, 16)))
    return AutoencoderKL(
        **{
            "block_out_channels": (16, 16),
            "down_block_types": ("DownEncoderBlock2D",) * blocks,
            "up_block_types": ("UpDecoderBlock2D",) * blocks,
            "latent_channels": 4,
            "norm_num_groups": 8,
            "sample_size": IMAGE_SIZE,
        }
        | shape
    )


def _unet(**extra) -> UNet2DConditionModel:
    return UNet2DConditionModel(
        **{
            "sample_size": IMAGE_SIZE // 2,
            "block_out_channels": (32, 64),
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
            "layers_per_block": 1,
            "attention_head_dim": 2,
            "norm_num_groups": 8,
        }
        | extra
    )


def build_sd15_folder(folder: Path, vae: dict | None = None, unet: dict | None = None) -> Path:
    """`vae`, `unet`: their configs where not the tiny defaults (LARGE_SD15)."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    vae_model, unet_model = _vae(**(vae or {})), _unet(cross_attention_dim=TEXT_DIM, **(unet or {}))
    return save_sd_folder(folder, vae_model, CLIPTextModel(_text_config(tokenizer)), tokenizer, unet_model)


def save_sd_folder(folder: Path, vae, text_encoder, tokenizer, unet) -> Path:
    """An SD-1.x pipeline of these parts and SD 1.5's published PNDM schedule, saved as diffusers
    saves one."""
    StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=PNDMScheduler.from_config(SD15_PNDM),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(folder, safe_serialization=True)
    return folder


def build_sdxl_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    StableDiffusionXLPipeline(
        vae=_vae(),
        text_encoder=CLIPTextModel(_text_config(tokenizer)),
        text_encoder_2=CLIPTextModelWithProjection(_text_config(tokenizer, projection_dim=TEXT_DIM)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=_unet(
            cross_attention_dim=2 * TEXT_DIM,  # both encoders' hidden states side by side
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=TEXT_DIM + 6 * 8,
        ),
        scheduler=EulerDiscreteScheduler.from_config(SDXL_EULER),
    ).save_pretrained(folder, safe_serialization=True)
    return folder


def build_sd15_inpainting_folder(folder: Path) -> Path:
    """SD-1.5's shape with an inpainting UNet: 9 input channels (latents, mask, masked image)."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    StableDiffusionInpaintPipeline(
        vae=_vae(),
        text_encoder=CLIPTextModel(_text_config(tokenizer)),
        tokenizer=tokenizer,
        unet=_unet(cross_attention_dim=TEXT_DIM, in_channels=9, out_channels=4),
        scheduler=PNDMScheduler.from_config(SD15_PNDM),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(folder, safe_serialization=True)
    return folder


BUILDERS = {"sd15": build_sd15_folder, "sdxl": build_sdxl_folder}


# FLUX.1: a transformer over packed 16-channel latents, CLIP's pooled vector and T5's tokens (a
# tiny T5 with a Unigram tokenizer built here: no download), a 16-channel VAE with FLUX's factors.
FLUX_LATENT_CHANNELS = 16
# FLUX.1-dev's scheduler config; schnell's: no dynamic shifting, shift 1
FLUX_DEV_SCHEDULE = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
FLUX_SCHNELL_SCHEDULE = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}


def build_t5_tokenizer() -> T5Tokenizer:
    """A Unigram T5 tokenizer (transformers 5's T5Tokenizer is the `tokenizers` one): <pad> 0,
    </s> 1, <unk> 2, then the built-in model's words and every letter."""
    pieces = ["<pad>", "</s>", "<unk>", "▁", *(f"▁{w}" for w in WORDS), *string.ascii_lowercase]
    vocab = [(p, 0.0 if i < 3 else -float(i)) for i, p in enumerate(dict.fromkeys(pieces))]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def _t5(tokenizer: T5Tokenizer) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=TEXT_DIM,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        d_kv=8,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        is_encoder_decoder=False,
        use_cache=False,
    )
    return T5EncoderModel(config)


def _flux_transformer(guidance: bool = True, **extra) -> FluxTransformer2DModel:
    """Tiny FLUX.1: 2 heads × 16; the rotary axes sum to the head size, as FLUX's 16 + 56 + 56 = 128."""
    config = {
        "patch_size": 1,
        "in_channels": 4 * FLUX_LATENT_CHANNELS,
        "num_layers": 2,
        "num_single_layers": 3,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": TEXT_DIM,
        "pooled_projection_dim": TEXT_DIM,
        "guidance_embeds": guidance,
        "axes_dims_rope": (4, 4, 8),
    }
    return FluxTransformer2DModel(**{**config, **extra})


def build_flux_folder(folder: Path, guidance: bool = True) -> Path:
    """guidance=True: FLUX.1-dev's shape (a guidance embedding, dynamic shift); False: schnell's."""
    torch.manual_seed(0)
    tokenizer, t5_tokenizer = build_tokenizer(), build_t5_tokenizer()
    FluxPipeline(
        transformer=_flux_transformer(guidance),
        scheduler=FlowMatchEulerDiscreteScheduler(
            **(FLUX_DEV_SCHEDULE if guidance else FLUX_SCHNELL_SCHEDULE)
        ),
        vae=_flow_vae(FLUX_LATENT_CHANNELS, scaling_factor=0.3611, shift_factor=0.1159),  # FLUX.1's
        text_encoder=CLIPTextModel(_text_config(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=_t5(t5_tokenizer),
        tokenizer_2=t5_tokenizer,
    ).save_pretrained(folder, safe_serialization=True)
    return folder


def build_flux_kontext_folder(folder: Path) -> Path:
    """FLUX.1 Kontext [dev]'s folder (`FluxKontextPipeline`): FLUX.1-dev's tiny parts, but a VAE
    of six blocks (32× down): the pipeline resizes the edit's image to ~1 MP (its preferred
    resolutions), which a 2× VAE would make 65,000 tokens; here 1024² is 16×16 tokens."""
    torch.manual_seed(0)
    tokenizer, t5_tokenizer = build_tokenizer(), build_t5_tokenizer()
    vae = AutoencoderKL(
        block_out_channels=(8,) * 6,
        down_block_types=("DownEncoderBlock2D",) * 6,
        up_block_types=("UpDecoderBlock2D",) * 6,
        latent_channels=FLUX_LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=1024,  # FLUX.1's (its tiles' size)
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    FluxKontextPipeline(
        transformer=_flux_transformer(True),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULE),
        vae=vae,
        text_encoder=CLIPTextModel(_text_config(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=_t5(t5_tokenizer),
        tokenizer_2=t5_tokenizer,
    ).save_pretrained(folder, safe_serialization=True)
    return folder


# Stable Diffusion 3: an MMDiT over 16-channel latents, two CLIP encoders with projections, and no T5
# (the pipeline then feeds zeros in its place). Scheduler and VAE factors are SD3-medium's.
SD3_SCHEDULE = {"num_train_timesteps": 1000, "shift": 3.0}
SD3_LATENT_CHANNELS = 16


def _sd3_transformer(**extra) -> SD3Transformer2DModel:
    """Tiny MMDiT: 4 heads × 8 = 32 = caption_projection_dim, as the blocks require."""
    config = {
        "sample_size": IMAGE_SIZE // 2,
        "patch_size": 2,
        "in_channels": SD3_LATENT_CHANNELS,
        "out_channels": SD3_LATENT_CHANNELS,
        "num_layers": 3,
        "attention_head_dim": 8,
        "num_attention_heads": 4,
        "caption_projection_dim": 32,
        "joint_attention_dim": 3 * TEXT_DIM,  # wider than both CLIPs side by side, as 4096 > 768 + 1280
        "pooled_projection_dim": 2 * TEXT_DIM,  # both CLIPs' projections side by side
        "pos_embed_max_size": IMAGE_SIZE // 2,
    }
    return SD3Transformer2DModel(**{**config, **extra})


def _flow_vae(channels: int, **factors: float) -> AutoencoderKL:
    """The tiny VAE with more latent channels, scaled and shifted, without quant convs (SD3, FLUX)."""
    return AutoencoderKL(
        block_out_channels=(16, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=channels,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
        **factors,
    )


def build_sd3_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    StableDiffusion3Pipeline(
        transformer=_sd3_transformer(),
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULE),
        vae=_flow_vae(SD3_LATENT_CHANNELS, scaling_factor=1.5305, shift_factor=0.0609),  # SD3-medium's
        text_encoder=CLIPTextModelWithProjection(_text_config(tokenizer, projection_dim=TEXT_DIM)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_text_config(tokenizer, projection_dim=TEXT_DIM)),
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    ).save_pretrained(folder, safe_serialization=True)
    return folder


def diffusers_image(pipe, request, **extra) -> np.ndarray:
    """What a diffusers pipeline makes for a (resolved) GenerationRequest: the reference image."""
    return pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        height=request.height,
        width=request.width,
        output_type="np",
        **extra,
    ).images[0]


def write_gguf(folder: Path, part: str, file: Path) -> Path:
    """The folder's `part` weights as a GGUF file, as FLUX.1 users download them: every matrix
    whose rows split into Q8_0's blocks of 32 quantized (gguf's own quantizer), the rest float32;
    diffusers' key names (`from_single_file` reads them unconverted)."""
    import gguf
    from safetensors.torch import load_file

    writer = gguf.GGUFWriter(str(file), arch="diffshard-test")
    for path in sorted((folder / part).glob("*.safetensors")):
        for key, tensor in load_file(path).items():
            array = tensor.float().numpy()
            if array.ndim == 2 and array.shape[-1] % 32 == 0:
                q8 = gguf.GGMLQuantizationType.Q8_0
                blocks = gguf.quants.quantize(array, q8)
                writer.add_tensor(key, blocks, raw_shape=blocks.shape, raw_dtype=q8)
            else:
                writer.add_tensor(key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def build_wan_folder(folder: Path, scheduler: object | None = None, **transformer: object) -> Path:
    """A tiny Wan 2.1 text-to-video folder (`WanPipeline`): a 2-block video transformer over
    1×2×2 patches (`transformer`: other sizes), a 3-channel-base causal 3D VAE (8× spatial, 4×
    temporal), a UMT5 encoder built from T5's tiny config, and the published UniPC scheduler
    (`wan_scheduler`; `scheduler`: another)."""
    from diffusers import WanPipeline

    parts = _wan_parts(**transformer)
    parts["scheduler"] = scheduler or parts["scheduler"]
    WanPipeline(**parts).save_pretrained(folder, safe_serialization=True)
    return folder


def build_wan_i2v_folder(folder: Path) -> Path:
    """A tiny Wan 2.1 image-to-video folder (`WanImageToVideoPipeline`): `build_wan_folder`'s
    parts with a transformer taking 36 channels (noise, the first frame's mask and latents) and
    CLIP image tokens (`image_dim` 32, projected to its 24-wide attention: `added_kv_proj_dim`),
    and a 2-layer CLIP vision encoder over 8-pixel patches of 32-pixel images (17 tokens): a
    `CLIPVisionModel`, as Wan-AI's I2V folders hold (the pipeline reads its hidden states only)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = _wan_parts(in_channels=36, image_dim=TEXT_DIM, added_kv_proj_dim=24)
    torch.manual_seed(1)
    encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=TEXT_DIM,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
    ).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    WanImageToVideoPipeline(**parts, image_encoder=encoder, image_processor=processor).save_pretrained(
        folder, safe_serialization=True
    )
    return folder


WAN_SHIFT_480P = 3.0  # Wan2.1-T2V-1.3B-Diffusers' flow_shift (its 720p folders: 5.0)


def wan_scheduler(flow_shift: float = WAN_SHIFT_480P) -> UniPCMultistepScheduler:
    """The scheduler every Wan-AI Diffusers folder ships (Wan 2.1 and 2.2): UniPC over flow
    sigmas, predicting the flow, as their scheduler_config.json says."""
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=flow_shift,
    )


def _wan_parts(**transformer: object) -> dict:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = build_t5_tokenizer()
    t5 = _t5(tokenizer).config.to_dict()
    encoder = UMT5EncoderModel(UMT5Config(**{k: v for k, v in t5.items() if k in UMT5Config().to_dict()}))
    return dict(
        transformer=WanTransformer3DModel(
            **{
                "patch_size": (1, 2, 2),
                "num_attention_heads": 2,
                "attention_head_dim": 12,
                "in_channels": 16,
                "out_channels": 16,
                "text_dim": TEXT_DIM,
                "freq_dim": 256,
                "ffn_dim": 32,
                "num_layers": 2,
                "cross_attn_norm": True,
                "qk_norm": "rms_norm_across_heads",
                "rope_max_seq_len": 32,
                **transformer,
            }
        ),
        vae=AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ),
        text_encoder=encoder,
        tokenizer=tokenizer,
        scheduler=wan_scheduler(),
    )
