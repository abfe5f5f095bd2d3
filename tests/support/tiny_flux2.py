"""Tiny FLUX.2 pipeline folders with random weights, built from config under fixed seeds and saved
as diffusers saves any pipeline (safetensors), after diffusers' own dummy components
(tests/pipelines/flux2/test_pipeline_flux2*.py) with their downloaded tokenizers replaced by ones
built here. Shapes follow the real models: FLUX.2 [dev] (`Flux2Pipeline`: a Mistral 3 text encoder,
the guidance-embedding transformer) and FLUX.2 [klein] (`Flux2KleinPipeline`: a Qwen3 text encoder,
no guidance embedding; distilled, or "klein-base" with classifier-free guidance), both over
AutoencoderKLFlux2 latents patchified 2×2 and normalised by the VAE's batch-norm statistics.

The text encoders (width 16) are one layer deeper (31 and 28) than the deepest of the pipelines'
default `text_encoder_out_layers` ((10, 20, 30) and (9, 18, 27)): transformers' last
`hidden_states` entry is the final norm's output, so every layer read is a raw residual stream, as
in the real 40- and 36-layer encoders. The context is three layers' hidden states side by side, so
the transformer's `joint_attention_dim` is 3 × 16, as FLUX.2-dev's 15360 is 3 × Mistral Small's 5120.

FLUX.2-dev's real "tokenizer" is a `PixtralProcessor`, which transformers 5 cannot build without
torchvision (the class is `@requires(backends=("torchvision", "torch"))`); the pipeline calls only
`tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True, padding=...)` for
text prompts, which a plain tokenizer with a chat template answers, so the dev folder holds a
byte-level BPE `TokenizersBackend` with Mistral's special tokens and a Mistral-style template
(caption upsampling, which calls `tokenizer.tokenizer.batch_decode` and passes images, needs the
processor and is not supported by this folder).

Run `python -m tests.support.tiny_flux2` (from the repository root, HF_HUB_OFFLINE=1) to build each variant,
load it back and generate 32×32 images, text-only and with one 64-pixel reference image."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2TokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from server.demo.tokenizer import WORDS

INNER_DIM = 32  # the transformer's width: 2 heads × 16
TEXT_HIDDEN = 16  # the text encoders' width; the context is 3 layers of it side by side
LATENT_CHANNELS = 4  # the VAE's; the transformer sees 4 × 4 = 16 after the 2×2 patchify
IMAGE_SIZE = 32  # pixels; the tiny VAE downsamples by 2, the patchify by 2 more: 8×8 = 64 tokens
REFERENCE_SIZE = 64  # Flux2ImageProcessor.check_image_input refuses reference images under 64 px
VARIANTS = ("dev", "klein", "klein-base")

# FLUX.2's published scheduler config (diffusers/FLUX.2-dev-bnb-4bit, converted from FLUX.1-dev's):
# the pipelines pass their own `mu` (compute_empirical_mu), so only the dynamic, exponential
# shifting matters; the base/max shift and sequence lengths are unused.
FLUX2_SCHEDULE = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}

# Mistral's tekken special tokens in their ids' order (<s> 1, </s> 2, [IMG] 10, <pad> 11, as in
# Mistral-Small-3.1's config: bos 1, eos 2, image_token_index 10).
MISTRAL_SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)
# Mistral-Small-3.1's template for what Flux2Pipeline sends (format_input): the system message's
# first text block in [SYSTEM_PROMPT], each user turn's text (images as [IMG]) in [INST].
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}"
    "{%- endif %}{%- endfor %}"
)

# Qwen3's special tokens (pad <|endoftext|>, eos <|im_end|>) and the part of its template that
# Flux2KleinPipeline reaches: one user turn, add_generation_prompt=True, enable_thinking=False.
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_THINK = ("<think>", "</think>")  # ordinary added tokens in Qwen3's vocabulary
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def _byte_level_bpe(specials: tuple[str, ...]) -> Tokenizer:
    """A byte-level BPE trained on FLUX.2's system message, Qwen's chat roles and the dataset's
    words: every byte is a token, each of those words one token (with and without its leading
    space), and the system message about 30 tokens, so it does not crowd a short max_sequence_length
    out (the pipelines truncate the whole templated text to it)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [SYSTEM_MESSAGE, "system", "user", "assistant", " ".join(WORDS), *WORDS]
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def build_mistral_tokenizer() -> PreTrainedTokenizerFast:
    """What Flux2Pipeline needs of its PixtralProcessor for text prompts, without torchvision: a
    tokenizer whose apply_chat_template takes format_input's conversations (saved as
    `TokenizersBackend`, transformers 5's PreTrainedTokenizerFast)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(MISTRAL_SPECIALS),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=MISTRAL_TEMPLATE,
    )


def build_qwen_tokenizer() -> Qwen2TokenizerFast:
    """Qwen3's tokenizer class (`Qwen2Tokenizer`: Qwen's own pre-tokenizer over the BPE's
    vocabulary and merges) with its special and thinking tokens and template."""
    bpe = json.loads(_byte_level_bpe(QWEN_SPECIALS).to_str())["model"]
    tokenizer = Qwen2TokenizerFast(
        vocab=bpe["vocab"],
        merges=[tuple(merge) for merge in bpe["merges"]],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN_TEMPLATE,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(list(QWEN_THINK))
    return tokenizer


def _out_layers(pipeline: type) -> tuple[int, ...]:
    """The hidden-state layers the pipeline stacks by default (its `text_encoder_out_layers`)."""
    return tuple(inspect.signature(pipeline.__call__).parameters["text_encoder_out_layers"].default)


def _mistral3(tokenizer: PreTrainedTokenizerFast) -> Mistral3ForConditionalGeneration:
    """Tiny Mistral Small 3.x: diffusers' dummy text config, one layer past the deepest one
    Flux2Pipeline reads (hidden_states[30]: 31 layers), with a one-layer Pixtral vision tower the
    text-only pipeline never runs."""
    ids = {
        name: tokenizer.convert_tokens_to_ids(tok)
        for name, tok in (("bos_token_id", "<s>"), ("eos_token_id", "</s>"), ("pad_token_id", "<pad>"))
    }
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 37,
            "max_position_embeddings": 1024,  # ≥ the pipelines' default max_sequence_length, 512
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": TEXT_HIDDEN // 4,
            "num_hidden_layers": max(_out_layers(Flux2Pipeline)) + 1,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            **ids,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": TEXT_HIDDEN,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 37,
            "image_size": 30,
            "patch_size": 6,
            "num_channels": 3,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        **ids,
    )
    return Mistral3ForConditionalGeneration(config).eval()


def _qwen3(tokenizer: Qwen2TokenizerFast) -> Qwen3ForCausalLM:
    """Tiny Qwen3 (diffusers' dummy, with Qwen3's 128-wide heads cut to 8), one layer past the
    deepest one Flux2KleinPipeline reads (hidden_states[27]: 28 layers)."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=TEXT_HIDDEN,
        num_hidden_layers=max(_out_layers(Flux2KleinPipeline)) + 1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        rope_theta=1000000.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen3ForCausalLM(config).eval()


def _transformer(guidance: bool, layers: tuple[int, ...]) -> Flux2Transformer2DModel:
    """Tiny FLUX.2 DiT (diffusers' dummy): 2 heads × 16; four rotary axes (t, h, w, l) of 4 that
    sum to the head size, as FLUX.2's 4 × 32 = 128; the context is `layers` text layers wide."""
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=INNER_DIM // 16,
        joint_attention_dim=len(layers) * TEXT_HIDDEN,
        timestep_guidance_channels=256,  # hardcoded in BFL's code
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance,
    )


def _vae() -> AutoencoderKLFlux2:
    """The project's tiny 2× VAE as AutoencoderKLFlux2 (quant convs kept, as FLUX.2's), with
    batch-norm statistics made up under the seed: the pipelines divide the patchified latents by
    sqrt(running_var + eps) after subtracting running_mean (a fresh BatchNorm2d's 0 and 1 would
    hide a missing normalisation)."""
    vae = AutoencoderKLFlux2(
        block_out_channels=(16, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
    )
    channels = vae.bn.num_features  # 4 × latent_channels (the 2×2 patch)
    vae.bn.running_mean.copy_(0.2 * torch.randn(channels))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels))
    return vae.eval()


def build_flux2_folder(folder: Path, variant: str = "dev") -> Path:
    """variant "dev": FLUX.2 [dev]'s shape (Flux2Pipeline: Mistral 3 text encoder, guidance
    embedding); "klein": FLUX.2 [klein] 4B/9B's (Flux2KleinPipeline, is_distilled: no CFG, guidance
    ignored); "klein-base": the undistilled klein (CFG against the empty prompt)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    torch.manual_seed(0)
    if variant == "dev":
        tokenizer = build_mistral_tokenizer()
        pipe = Flux2Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULE),
            vae=_vae(),
            text_encoder=_mistral3(tokenizer),
            tokenizer=tokenizer,
            transformer=_transformer(guidance=True, layers=_out_layers(Flux2Pipeline)),
        )
    else:
        tokenizer = build_qwen_tokenizer()
        pipe = Flux2KleinPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULE),
            vae=_vae(),
            text_encoder=_qwen3(tokenizer),
            tokenizer=tokenizer,
            transformer=_transformer(guidance=False, layers=_out_layers(Flux2KleinPipeline)),
            is_distilled=variant == "klein",
        )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def reference_image(size: int = REFERENCE_SIZE) -> Image.Image:
    """A red square on grey: FLUX.2's `image=` (a reference to edit or compose from)."""
    pixels = np.full((size, size, 3), 128, dtype=np.uint8)
    pixels[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = (220, 30, 30)
    return Image.fromarray(pixels)


def _run(pipe: Flux2Pipeline | Flux2KleinPipeline, image: Image.Image | None, guidance: float) -> np.ndarray:
    return pipe(
        prompt="a red circle",
        image=image,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        num_inference_steps=2,
        guidance_scale=guidance,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
    ).images


if __name__ == "__main__":
    import tempfile
    import time

    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as root:
        for variant in VARIANTS:
            started = time.perf_counter()
            folder = build_flux2_folder(Path(root) / variant, variant)
            cls = Flux2Pipeline if variant == "dev" else Flux2KleinPipeline
            pipe = cls.from_pretrained(folder, local_files_only=True)
            pipe.set_progress_bar_config(disable=True)
            guidance = 1.0 if variant == "klein" else 4.0  # distilled klein ignores guidance
            text_only = _run(pipe, None, guidance)
            edit = _run(pipe, reference_image(), guidance)
            print(f"{variant:10s} text-to-image {text_only.shape} std {text_only.std():.4f}")
            print(
                f"{variant:10s} {REFERENCE_SIZE}px reference {edit.shape} std {edit.std():.4f}"
                f" (max change {np.abs(edit - text_only).max():.4f})"
            )
            print(f"{variant:10s} built, loaded and ran in {time.perf_counter() - started:.1f}s")
