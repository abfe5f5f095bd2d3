"""A tiny Z-Image (Tongyi-MAI's Z-Image / Z-Image-Turbo) pipeline folder with random weights, built
from config under a fixed seed and saved as diffusers saves any pipeline (safetensors).

Shapes follow the real model in miniature (diffusers' own dummy components in
tests/pipelines/z_image/test_z_image.py, with a local tokenizer instead of a hub download): a
single-stream DiT over 2x2 patches of 16-channel latents (noise and context refiners, then joint
layers, 3-axis RoPE whose axes sum to the head size as Z-Image's 32 + 48 + 48 = 128), a Qwen3 text
encoder whose second-to-last hidden states are the caption features, a Qwen2 byte-level BPE
tokenizer with Qwen3's chat template, the FLUX-style 16-channel VAE with its factors, and
Z-Image-Turbo's scheduler (flow matching, static shift 3). Nothing is downloaded.

`python -m tests.support.tiny_zimage` (with HF_HUB_OFFLINE=1) builds a folder, loads it back and runs it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from server.demo.tokenizer import WORDS
from tests.support.tiny_qwen import byte_merges

TEXT_DIM = 32  # the text encoder's hidden size = the transformer's cap_feat_dim (Z-Image: 2560)
LATENT_CHANNELS = 16
IMAGE_SIZE = 32  # pixels; the 2-block VAE makes 16x16 latents, 8x8 = 64 image tokens of 2x2 patches

# Qwen's special tokens (real ids 151643, 151644, 151645), and the pair Qwen3's template emits when
# thinking is disabled (ZImagePipeline passes enable_thinking=True, so they never appear there).
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"

# Qwen3's chat template, reduced to what a list of plain {role, content} messages uses: each message
# as <|im_start|>{role}\n{content}<|im_end|>\n, then the assistant header; with enable_thinking
# false also an empty think block. ZImagePipeline's prompt therefore reads
# "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Z-Image-Turbo's published scheduler_config.json: a static shift (no resolution-dependent mu).
ZIMAGE_TURBO_SCHEDULE = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}


def build_qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2Tokenizer (the class Z-Image-Turbo's tokenizer folder names): all 256 byte
    symbols, so any text tokenizes; the built-in model's words, alone and after a space ("Ġred"), and
    the chat roles as one token each; Qwen's special tokens; Qwen3's chat template."""
    words = [*WORDS, "user", "assistant"]
    pretokens = [w for word in words for w in (word, "Ġ" + word)]
    merges = byte_merges(pretokens)
    tokens = [*sorted(ByteLevel.alphabet()), *(left + right for left, right in merges)]
    vocab = {
        tok: i
        for i, tok in enumerate(dict.fromkeys([*tokens, ENDOFTEXT, IM_START, IM_END, THINK, END_THINK]))
    }
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,  # Qwen3-4B's tokenizer: eos <|im_end|>, pad <|endoftext|>
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END, ENDOFTEXT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=131072,
    )
    split = [w for w in words if len(tokenizer.tokenize(w)) != 1 or len(tokenizer.tokenize(" " + w)) != 1]
    if split:
        raise RuntimeError(f"the tokenizer splits {split}: the BPE merges are wrong")
    message = [{"role": "user", "content": "a red circle"}]
    chat = tokenizer.apply_chat_template(
        message, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    # <|im_start|> user \n a Ġred Ġcircle <|im_end|> \n <|im_start|> assistant \n
    if len(tokenizer(chat).input_ids) != 11:
        raise RuntimeError(f"unexpected chat tokens: {tokenizer.tokenize(chat)}")
    return tokenizer


def _text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen3Model:
    """Tiny Qwen3 (the pipeline's `text_encoder` is a bare Qwen3Model): GQA 4 query / 2 KV heads of 8,
    as Qwen3-4B's 32 / 8 of 128; 2 layers, so hidden_states[-2] is the first layer's output."""
    return Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_DIM,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
            eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()


def _transformer(**extra: object) -> ZImageTransformer2DModel:
    """Tiny Z-Image DiT: 2 heads x 16 = 32 wide, RoPE axes 8 + 4 + 4 = 16 (Z-Image: 30 x 128, 32 + 48 + 48);
    Z-Image's axes_lens, so captions up to the pipeline's 512 tokens fit."""
    config = {
        "all_patch_size": (2,),
        "all_f_patch_size": (1,),
        "in_channels": LATENT_CHANNELS,
        "dim": 32,
        "n_layers": 2,
        "n_refiner_layers": 2,
        "n_heads": 2,
        "n_kv_heads": 2,
        "norm_eps": 1e-5,
        "qk_norm": True,
        "cap_feat_dim": TEXT_DIM,
        "rope_theta": 256.0,
        "t_scale": 1000.0,
        "axes_dims": [8, 4, 4],
        "axes_lens": [1536, 512, 512],
    }
    transformer = ZImageTransformer2DModel(**{**config, **extra})
    with torch.no_grad():  # learned in the real model; zeros here would hide whether padding is handled
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    return transformer.eval()


def _vae() -> AutoencoderKL:
    """The FLUX VAE's layout (16 latent channels, no quant convs, its scale and shift) with two 16-wide
    blocks: 2x downsampling instead of 8x."""
    return AutoencoderKL(
        block_out_channels=(16, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    ).eval()


def build_zimage_pipeline(**transformer: object) -> ZImagePipeline:
    """The tiny pipeline in memory (`transformer`: config overrides)."""
    torch.manual_seed(0)
    tokenizer = build_qwen_tokenizer()
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_TURBO_SCHEDULE),
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=_transformer(**transformer),
    )


def build_zimage_folder(folder: Path) -> Path:
    """A tiny Z-Image-Turbo folder, for ZImagePipeline.from_pretrained(folder, local_files_only=True)."""
    build_zimage_pipeline().save_pretrained(folder, safe_serialization=True)
    return folder


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pipe = ZImagePipeline.from_pretrained(
            build_zimage_folder(Path(tmp) / "zimage"), local_files_only=True
        )
        pipe.set_progress_bar_config(disable=True)
        runs = {
            "unguided (Turbo: guidance 0)": {"guidance_scale": 0.0},
            "guided (CFG 3, negative prompt)": {
                "guidance_scale": 3.0,
                "negative_prompt": ["a blue square", ""],
            },
            "guided, cfg_normalization 1, cfg_truncation 0.5": {
                "guidance_scale": 3.0,
                "negative_prompt": ["a blue square", ""],
                "cfg_normalization": 1.0,
                "cfg_truncation": 0.5,
            },
        }
        first = None
        for name, extra in runs.items():
            images = pipe(
                prompt=["a red circle", "a green triangle"],
                height=IMAGE_SIZE,
                width=IMAGE_SIZE,
                num_inference_steps=3,
                generator=torch.Generator("cpu").manual_seed(0),
                output_type="pt",
                **extra,
            ).images
            first = images if first is None else first
            diff = (images - first).abs().max().item()
            shape, std = tuple(images.shape), images.std().item()
            print(f"{name}: images {shape}, std {std:.4f}, max |Δ| vs unguided {diff:.2e}")
