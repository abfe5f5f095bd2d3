"""Tiny HunyuanVideo-1.5 folders (text-to-video, and image-to-video: `build_hunyuan15_i2v_folder`)
with random weights, built from config under fixed seeds and saved as diffusers saves
`HunyuanVideo15Pipeline` (safetensors), laid out as
`hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v` is (diffusers'
scripts/convert_hunyuan_video1_5_to_diffusers.py makes it): the transformer (`in_channels` =
2 × latent channels + 1: the noise, a first frame's latents and its mask), the 16×-spatial,
4×-temporal VAE, Qwen2.5-VL's language model and its tokenizer (with Qwen2-VL's chat template),
ByT5 with the glyph tokens added, FlowMatchEuler at shift 5 and the guider
(`ClassifierFreeGuidance`, scale 6). The parts follow diffusers' dummy
components (tests/pipelines/hunyuan_video1_5/test_hunyuan_1_5.py) with no download:

* the tokenizer is a byte-level BPE whose merges make every word of the pipeline's system
  message one token: its prefix is 123 tokens, at least what the real tokenizer makes of it, so
  the pipeline's crop of 108 (`prompt_template_encode_start_idx`) leaves the message's tail before
  the prompt, as it does with the real one;
* ByT5's tokenizer needs no vocabulary (bytes); a few of the glyph model's color and font tokens
  are added, as the published one adds them all.

`python -m tests.support.tiny_hunyuan15` builds a folder, loads it back and runs the pipeline."""

from __future__ import annotations

import inspect
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from server.demo.tokenizer import WORDS
from server.requests import GenerationRequest
from tests.support.tiny_qwen import SPECIAL_TOKENS, _qwen2_tokenizer, _words, byte_merges

TEXT_DIM = 32  # Qwen2.5-VL-7B's 3584: the transformer's text_embed_dim
GLYPH_DIM = 32  # byt5-small's d_model 1472: text_embed_2_dim
IMAGE_DIM = 12  # SigLIP's 1152: image_embed_dim (text-to-video feeds zeros)
LATENT_CHANNELS = 4  # the published VAE's 32
SIDE = 64  # pixels: 4×4 latents (16× spatial), 16 tokens a latent frame (1×1 patches)
PREFIX_TOKENS = 123  # the templated system prefix, each of its pre-tokens one token
SHIFT, GUIDANCE = 5.0, 6.0  # 480p_t2v's scheduler shift and guider scale (720p: 9.0; distilled: 1.0)
GLYPH_TOKENS = ("<color-0>", "<color-1>", "<en-font-0>", "<en-font-1>")

# Qwen2-VL's chat template for messages whose content is a string (the pipeline's): a system
# message first (the default one if the conversation has none), each message in <|im_start|> …
# <|im_end|>, then the assistant's header.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _system_message() -> str:
    """The pipeline's (its prompt encoding's default, which its instances pass)."""
    encode = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    return encode.parameters["system_message"].default


def _prefix(system: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"


def build_tokenizer() -> Qwen2Tokenizer:
    """Merges that make the demo's words, the roles and every word of the system message one
    token each (Qwen2.5's vocabulary holds them whole, or in more pieces): the templated prefix
    is then 123 tokens, the fewest any tokenizer with Qwen2's pre-tokenizer gives it, so the
    pipeline's crop of 108 leaves the message's last words and the user's header before the
    prompt, as it does with the real tokenizer."""
    system = _system_message()
    alphabet = sorted(ByteLevel.alphabet())
    plain = _qwen2_tokenizer({c: i for i, c in enumerate(alphabet)}, [])
    words = _words(plain, [" ".join(WORDS), "system user assistant", _prefix(system)])
    merges = byte_merges(words)
    vocab = {t: i for i, t in enumerate(dict.fromkeys([*alphabet, *(a + b for a, b in merges)]))}
    vocab.update({t: len(vocab) + i for i, t in enumerate(SPECIAL_TOKENS)})
    tokenizer = _qwen2_tokenizer(vocab, merges)
    tokenizer.chat_template, tokenizer.padding_side = CHAT_TEMPLATE, "right"  # as the converter saves it
    if (length := len(tokenizer(_prefix(system)).input_ids)) != PREFIX_TOKENS:
        raise RuntimeError(f"the system prefix is {length} tokens, not {PREFIX_TOKENS}")
    return tokenizer


def build_glyph_tokenizer() -> ByT5Tokenizer:
    tokenizer = ByT5Tokenizer()
    tokenizer.add_tokens(list(GLYPH_TOKENS), special_tokens=True)
    return tokenizer


def _text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLTextModel:
    """Three layers of Qwen2.5-VL's language model (the pipeline reads hidden_states[-3]: here the
    first layer's output), 2 query heads sharing 1 key/value head as the 7B's 28 share 4."""
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=37,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    return Qwen2_5_VLTextModel(config).eval()


def _glyph_encoder(tokenizer: ByT5Tokenizer) -> T5EncoderModel:
    """byt5-small's shape in miniature (gated GELU, relative attention), its vocabulary grown by
    the glyph tokens as the converter grows it."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=GLYPH_DIM,
        d_ff=37,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
    )
    return T5EncoderModel(config).eval()


def build_hunyuan15_folder(folder: Path, **transformer: object) -> Path:
    """`transformer`: other sizes of the transformer (the benchmarks' larger one)."""
    HunyuanVideo15Pipeline(**_parts("t2v", **transformer)).save_pretrained(folder, safe_serialization=True)
    return folder


def build_hunyuan15_i2v_folder(folder: Path) -> Path:
    """`hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v`'s layout: the same parts (the transformer's
    `task_type` i2v) and SigLIP's vision tower with its image processor (so400m-patch14-384's: 729
    tokens of 1152; here 16 of IMAGE_DIM, over 14-pixel patches of 56-pixel images)."""
    torch.manual_seed(0)
    encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=IMAGE_DIM,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        )
    ).eval()
    processor = SiglipImageProcessor(size={"height": 56, "width": 56})
    HunyuanVideo15ImageToVideoPipeline(
        **_parts("i2v"), image_encoder=encoder, feature_extractor=processor
    ).save_pretrained(folder, safe_serialization=True)
    index = json.loads((folder / "model_index.json").read_text())
    index["feature_extractor"] = ["transformers", "SiglipImageProcessor"]  # its PIL stand-in here
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder


def _parts(task: str, **sizes: object) -> dict[str, Any]:
    """The pipeline's parts; `sizes`: the transformer's other sizes."""
    config = {
        "in_channels": 2 * LATENT_CHANNELS + 1,
        "out_channels": LATENT_CHANNELS,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "num_layers": 2,
        "num_refiner_layers": 2,
        "mlp_ratio": 2.0,
        "patch_size": 1,
        "patch_size_t": 1,
        "text_embed_dim": TEXT_DIM,
        "text_embed_2_dim": GLYPH_DIM,
        "image_embed_dim": IMAGE_DIM,
        "rope_axes_dim": (2, 2, 4),
        "target_size": SIDE,
        "task_type": task,
    }
    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(**(config | sizes)).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(8, 8, 8, 8, 8),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
    ).eval()
    tokenizer, glyphs = build_tokenizer(), build_glyph_tokenizer()
    torch.manual_seed(0)
    text_encoder = _text_encoder(tokenizer)
    torch.manual_seed(0)
    glyph_encoder = _glyph_encoder(glyphs)
    return {
        "transformer": transformer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": glyph_encoder,
        "tokenizer_2": glyphs,
        "guider": ClassifierFreeGuidance(guidance_scale=GUIDANCE),
    }


def hunyuan_video(
    folder: Path, request: GenerationRequest, image: object = None, tiled: bool = False
) -> np.ndarray:
    """HunyuanVideo15Pipeline's frames [frames, height, width, 3] in [0, 1] for a request whose
    prompts, size, frames, steps, scale and seed are set: the scale is the guider's (a copy of
    the folder's with it); `tiled`: decoded after `vae.enable_tiling()`. With `image`,
    HunyuanVideo15ImageToVideoPipeline's (its size is the image's, at `target_size`)."""
    cls = HunyuanVideo15Pipeline if image is None else HunyuanVideo15ImageToVideoPipeline
    pipe = cls.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = pipe.guider.new(guidance_scale=request.guidance_scale)
    if tiled:
        pipe.vae.enable_tiling()
    sized = {"height": request.height, "width": request.width} if image is None else {"image": image}
    return pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        **sized,
        num_frames=request.frames,
        num_inference_steps=request.steps,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
    ).frames[0]


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        started = time.monotonic()
        folder = build_hunyuan15_folder(Path(root) / "hunyuan15")
        pipe = HunyuanVideo15Pipeline.from_pretrained(folder, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        frames = pipe(
            prompt='a red circle saying "hello"',
            height=SIDE,
            width=SIDE,
            num_frames=9,
            num_inference_steps=2,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="np",
        ).frames[0]
        print(f"{frames.shape} std {frames.std():.3f} in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
