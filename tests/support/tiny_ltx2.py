"""A tiny LTX-2 folder (text to video with audio) with random weights, built from config under fixed
seeds and saved as diffusers saves `LTX2Pipeline` (safetensors), laid out as `Lightricks/LTX-2` is:
Gemma 3 (`Gemma3ForConditionalGeneration`, its vision tower unused) and its tokenizer, the text
connectors, the audio-video transformer, the video VAE, the audio VAE, the vocoder and the
FlowMatchEuler scheduler with LTX-2's dynamic shifting. The parts follow diffusers' dummy components
(tests/pipelines/ltx2/testing_utils.py) with no download, except where the published folder differs:

* the tokenizer is Gemma's (`GemmaTokenizer`, which transformers 5 also names `GemmaTokenizerFast`):
  SentencePiece-style BPE over "▁"-joined text with byte fallback, <pad> 0, <eos> 1, <bos> 2, <unk> 3,
  <bos> prepended, left padding; its merges are trained here on the demo's words and a few sentences;
* the connectors replace padding by learnable registers, as the published ones do (128 of them, prompts
  padded to 1024 tokens): the padded length must be a multiple of REGISTERS, as TEXT_TOKENS is, and
  the connectors' width (heads × head size) must be the text encoder's, as 30 × 128 = 3840 is;
* the transformer's rotary positions use the tiny VAE's strides (`vae_scale_factors`), as the
  published (8, 32, 32) are the published VAE's, and its self-attention can be perturbed
  (`perturbed_attn`, as LTX-2.3's): diffusers' LTX-2.0 config leaves it False, which makes STG a
  no-op that still costs a transformer pass (`perturbed_attn=False` builds that folder);
* the vocoder upsamples each mel frame to hop × output rate / sample rate = 160 samples, so its
  waveform lasts as long as the video (the published one's 240 samples at 24 kHz do; the dummy's 4
  do not), and its weights are Kaiming-normal: PyTorch's default init shrinks the mel ~600×, leaving
  a waveform of biases that no change of the latents moves;
* the VAEs' latent statistics are seeded random (zero mean, unit std hide a missing normalization);
  the audio VAE's have `base_channels` entries and apply to packed features (channel × latent mel
  bin), so `base_channels` is set to that product (4; 128 = 8 × 16 published);
* the transformer's prompt cross-attentions (video and audio) scale their keys by PROMPT_KEY_SCALE:
  a prompt's few tokens sit among ~1020 registers, and at init's near-uniform attention they move
  the frames by ~1e-4 (a prompt swap; CFG ~1e-3); sharper, as trained attention is, ~1e-2.

Sizes for `frames` at `frame_rate` and a side of `s` pixels: the video VAE compresses 2× in time and
space (one "spatial" down block; its decoder upsamples time and space), so latents are
[1, 4, (frames - 1) // 2 + 1, s / 2, s / 2], one token each (patch 1): 9 frames at 32 px give
[1, 4, 5, 16, 16], 1280 tokens of 4. Audio latents are [1, 2, L, 2] (8 mel bins / 4), packed
[1, L, 4] (channels × mel bins, the transformer's `audio_in_channels`), where
L = round(frames / frame_rate × 16000 / 160 / 4): 9 frames at 24 fps last 0.375 s, L = round(9.375) = 9.
The audio VAE decodes them to a [1, 2, 4L - 3, 8] mel spectrogram (causal: 33 frames) and the vocoder
to a [1, 2, 160 × (4L - 3)] waveform at 16 kHz ([2, 5280] here).

`build_ltx2_folder(version="2.3")` builds LTX-2.3's architecture instead (what LTX2Pipeline's
defaults target: gated attention, the prompt modulated by the timestep, the connectors projecting
each stream's prompt to its blocks' width, `LTX23_TRANSFORMER`).

`python -m tests.support.tiny_ltx2` builds a folder, loads it back and runs the pipeline."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2ImageToVideoPipeline,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizerFast

from server.demo.tokenizer import WORDS

TEXT_HIDDEN = 16  # Gemma 3 12B's 3840: the connectors' and the transformer's caption_channels
TEXT_LAYERS = 2  # 12B's 48; the pipeline stacks all TEXT_LAYERS + 1 hidden states
TEXT_TOKENS = 1024  # prompts' padded length: LTX2Pipeline's max_sequence_length default, the server's
REGISTERS = 8  # the connectors' learnable registers (128 published): padded lengths are multiples
LATENT_CHANNELS = 4  # the video VAE's (128 published)
AUDIO_CHANNELS, MEL_BINS = 2, 8  # the audio VAE's latent channels and mel bins (8 and 64 published)
SAMPLE_RATE, HOP = 16000, 160  # the audio VAE's mel frames: 100 a second, as published
MEL_DOWNSAMPLE = 4  # the audio VAE's fixed time and mel compression (LATENT_DOWNSAMPLE_FACTOR)
SIDE, FRAMES, FRAME_RATE = 32, 9, 24.0
PROMPT_KEY_SCALE = 8.0  # the prompt cross-attentions' key norm weights (1 at init): see the docstring

# Lightricks/LTX-2's scheduler_config.json (the pipeline computes `mu` from these and passes sigmas).
LTX2_SCHEDULE = {
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
}
# Gemma's special tokens in its ids' order, then its image markers (ids 255999, 256000, 262144 in
# Gemma 3's vocabulary); the 256 byte-fallback tokens <0x00>..<0xFF> follow.
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
CORPUS = (
    " ".join(WORDS),
    "a robot dancing in the rain, cinematic lighting",
    "a red circle moving on a dark background",
    "worst quality, inconsistent motion, blurry, jittery, distorted",
)


def build_tokenizer() -> GemmaTokenizerFast:
    """Gemma's pipeline (spaces to "▁", no pre-split, byte fallback) over merges trained on CORPUS
    and the demo's words, each of which (after a space) becomes one token."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # for training only
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=list(GEMMA_SPECIALS), show_progress=False)
    bpe.train_from_iterator([*CORPUS, *(f" {word}" for word in WORDS)], trainer)
    trained = json.loads(bpe.to_str())["model"]
    learned = [t for t in sorted(trained["vocab"], key=trained["vocab"].get) if t not in GEMMA_SPECIALS]
    tokens = [*GEMMA_SPECIALS, *IMAGE_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *learned]
    tokenizer = GemmaTokenizerFast(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[tuple(merge) for merge in trained["merges"]],
        add_bos_token=True,
        additional_special_tokens=list(IMAGE_TOKENS),
    )
    if split := [w for w in WORDS if len(tokenizer.tokenize(f" {w}")) != 1]:
        raise RuntimeError(f"the tokenizer splits {split}")
    return tokenizer


def _text_encoder(tokenizer: GemmaTokenizerFast) -> Gemma3ForConditionalGeneration:
    """Diffusers' dummy Gemma 3 (hf-internal-testing/tiny-gemma3's text sizes) built from config: 2
    query heads sharing 1 key/value head of 8, a sliding-window and a global layer as Gemma 3 mixes
    them, and a one-layer SigLIP tower the pipeline never runs."""
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 32,
            "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "query_pre_attn_scalar": 8,  # the head size, as Gemma 3's 256
            "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
            "pad_token_id": ids("<pad>"),
            "eos_token_id": ids("<eos>"),
            "bos_token_id": ids("<bos>"),
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
    )
    return Gemma3ForConditionalGeneration(config).eval()


# LTX-2.3's architecture (what LTX2Pipeline's defaults target): gated attention, the prompt's
# modulation by the timestep, perturbable self-attention, and the prompt projected per stream in
# the connectors (each stream's width), not in the transformer
LTX23_TRANSFORMER = {
    "gated_attn": True,
    "cross_attn_mod": True,
    "audio_gated_attn": True,
    "audio_cross_attn_mod": True,
    "use_prompt_embeddings": False,
    "rope_double_precision": True,
}


def _parts(version: str = "2.0", **sizes: Any) -> dict[str, Any]:
    """The pipeline's parts, each built under torch.manual_seed(0); `version`: "2.0" (diffusers'
    dummy's architecture) or "2.3"; `sizes`: other transformer sizes."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    text_encoder = _text_encoder(tokenizer)
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()  # use_framewise_encoding/decoding: attributes, not config, False at every load
    vae.latents_mean.copy_(0.1 * torch.randn(LATENT_CHANNELS))
    vae.latents_std.copy_(1.0 + 0.1 * torch.rand(LATENT_CHANNELS))
    torch.manual_seed(0)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=AUDIO_CHANNELS * (MEL_BINS // MEL_DOWNSAMPLE),  # its latents_mean/std's size
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=AUDIO_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=SAMPLE_RATE,
        mel_hop_length=HOP,
        is_causal=True,
        mel_bins=MEL_BINS,
    ).eval()
    packed = audio_vae.latents_mean.numel()  # per packed feature (channel × latent mel bin)
    audio_vae.latents_mean.copy_(0.1 * torch.randn(packed))
    audio_vae.latents_std.copy_(1.0 + 0.1 * torch.rand(packed))
    torch.manual_seed(0)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * MEL_BINS,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[20, 8, 8],
        upsample_factors=[10, 4, 4],  # 160 = HOP samples a mel frame at SAMPLE_RATE
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=SAMPLE_RATE,
    ).eval()
    for weight in (p for p in vocoder.parameters() if p.dim() > 1):  # see the module docstring
        torch.nn.init.kaiming_normal_(weight, a=0.1, nonlinearity="leaky_relu")
    # 2.3: each stream's connector as wide as its blocks (published 32 × 128 and 32 × 64)
    newer = version == "2.3"
    video_width, audio_width = (16, 8) if newer else (TEXT_HIDDEN, TEXT_HIDDEN)
    more = {"per_modality_projections": True, "video_hidden_dim": 16, "audio_hidden_dim": 8} if newer else {}
    more |= {"video_gated_attn": True, "audio_gated_attn": True, "proj_bias": True} if newer else {}
    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_HIDDEN,
        text_proj_in_factor=TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2,  # 2 × 8 = TEXT_HIDDEN, as 30 × 128 = 3840 published
        video_connector_attention_head_dim=video_width // 2,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=REGISTERS,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=audio_width // 2,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=REGISTERS,
        connector_rope_base_seq_len=4096,  # published (the dummy's 32)
        rope_theta=10000.0,
        rope_double_precision=False,
        causal_temporal_positioning=False,
        rope_type="split",
        **more,
    ).eval()
    config = {
        "in_channels": LATENT_CHANNELS,
        "out_channels": LATENT_CHANNELS,
        "patch_size": 1,
        "patch_size_t": 1,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "cross_attention_dim": 16,
        "vae_scale_factors": (vae.temporal_compression_ratio, *(2 * (vae.spatial_compression_ratio,))),
        "audio_in_channels": AUDIO_CHANNELS * (MEL_BINS // MEL_DOWNSAMPLE),
        "audio_out_channels": AUDIO_CHANNELS * (MEL_BINS // MEL_DOWNSAMPLE),
        "audio_num_attention_heads": 2,
        "audio_attention_head_dim": 4,
        "audio_cross_attention_dim": 8,
        "audio_sampling_rate": SAMPLE_RATE,
        "audio_hop_length": HOP,
        "num_layers": 2,
        "qk_norm": "rms_norm_across_heads",
        "caption_channels": TEXT_HIDDEN,
        "rope_double_precision": False,
        "rope_type": "split",
        "perturbed_attn": True,  # see the module docstring
    }
    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        **(config | (LTX23_TRANSFORMER if newer else {}) | sizes)
    ).eval()
    for block in transformer.transformer_blocks:  # see the module docstring
        for attention in (block.attn2, block.audio_attn2):
            attention.norm_k.weight.data.fill_(PROMPT_KEY_SCALE)
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULE),
        "vae": vae,
        "audio_vae": audio_vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "connectors": connectors,
        "transformer": transformer,
        "vocoder": vocoder,
    }


def build_ltx2_folder(root: Path | None = None, version: str = "2.0", **transformer: Any) -> Path:
    """Saves the folder as `root`/ltx2 (under a new temporary directory, the caller's to remove, when
    `root` is None) and returns it; `transformer`: other transformer sizes (e.g. num_layers=4)."""
    folder = Path(tempfile.mkdtemp(prefix="tiny-ltx2-") if root is None else root) / "ltx2"
    LTX2Pipeline(**_parts(version, **transformer)).save_pretrained(folder, safe_serialization=True)
    return folder


def load_reference(folder: Path) -> LTX2Pipeline:
    """The folder's LTX2Pipeline in float32 on the CPU, its progress bar off."""
    pipe = LTX2Pipeline.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to("cpu")


def ltx2_reference(
    pipe: LTX2Pipeline,
    *,
    prompt: str,
    negative_prompt: str | None = None,
    seed: int,
    steps: int,
    width: int = SIDE,
    height: int = SIDE,
    frames: int = FRAMES,
    frame_rate: float = FRAME_RATE,
    guidance_scale: float = 3.0,
    stg_scale: float = 1.0,
    modality_scale: float = 3.0,
    guidance_rescale: float = 0.7,
    audio_guidance_scale: float | None = None,
    audio_stg_scale: float | None = None,
    audio_modality_scale: float | None = None,
    audio_guidance_rescale: float | None = None,
    stg_blocks: Sequence[int] = (1,),
    use_cross_timestep: bool = True,
    max_sequence_length: int = TEXT_TOKENS,
    image: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """LTX2Pipeline's frames [frames, height, width, 3] in [0, 1] and waveform [channels, samples]
    (float32). The video's guidance defaults are the pipeline's; an audio scale that is None *or 0*
    takes the video's (the pipeline's `audio_x or x`), so audio STG cannot be off while video STG is
    on. CFG runs when either guidance scale is over 1 (negative_prompt None: the empty prompt), STG
    (at `stg_blocks`) when either STG scale is over 0, modality isolation when either modality scale
    is over 1. `use_cross_timestep`: True is LTX-2.3's cross-attention modulation (the pipeline's
    default), False LTX-2.0's; `image`: a first frame, for LTX2ImageToVideoPipeline's video.
    `steps` must be 2 or more: with the scheduler's shift_terminal a single
    step's sigma is 0 / 0 (NaN frames)."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (shift_terminal makes one step's sigma NaN), got {steps}")
    kwargs: dict[str, Any] = {}
    if image is not None:  # LTX2ImageToVideoPipeline over the same parts, its CRF the default
        pipe = LTX2ImageToVideoPipeline(**pipe.components)
        pipe.set_progress_bar_config(disable=True)
        kwargs["image"] = image
    video, audio = pipe(
        **kwargs,
        prompt=prompt,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        num_frames=frames,
        frame_rate=frame_rate,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        stg_scale=stg_scale,
        modality_scale=modality_scale,
        guidance_rescale=guidance_rescale,
        audio_guidance_scale=audio_guidance_scale,
        audio_stg_scale=audio_stg_scale,
        audio_modality_scale=audio_modality_scale,
        audio_guidance_rescale=audio_guidance_rescale,
        spatio_temporal_guidance_blocks=list(stg_blocks) or None,
        use_cross_timestep=use_cross_timestep,
        max_sequence_length=max_sequence_length,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        return_dict=False,
    )
    return np.asarray(video[0], dtype=np.float32), audio[0].float().cpu().numpy()


def main() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as root:
        started = time.monotonic()
        pipe = load_reference(build_ltx2_folder(Path(root)))
        print(f"built and loaded in {time.monotonic() - started:.1f} s")
        guided = {"guidance_scale": 3.0, "stg_scale": 1.0, "modality_scale": 3.0, "guidance_rescale": 0.7}
        plain = {"guidance_scale": 1.0, "stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0}
        for name, scales in (("guided", guided), ("unguided", plain)):
            started = time.monotonic()
            video, audio = ltx2_reference(pipe, prompt="a red circle", seed=0, steps=2, **scales)
            for what, x in (("video", video), ("audio", audio)):
                if not np.isfinite(x).all() or x.std() == 0:
                    raise RuntimeError(f"the {name} {what} is not finite or constant")
            print(
                f"{name:8s} video {video.shape} std {video.std():.3f}, audio {audio.shape}"
                f" std {audio.std():.3f} at {pipe.vocoder.config.output_sampling_rate} Hz"
                f" in {time.monotonic() - started:.1f} s"
            )


if __name__ == "__main__":
    main()
