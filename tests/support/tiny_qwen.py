"""Tiny Qwen-Image-family pipeline folders with random weights, built from config under fixed seeds
and saved as diffusers saves any pipeline (safetensors): Qwen-Image (text to image), Qwen-Image-Edit
and Qwen-Image-Edit-2509 ("Plus", several condition images). The parts follow diffusers' own dummy
components (tests/pipelines/qwenimage/test_qwenimage*.py) at the real models' channel counts where
the pipelines read them (16 latent channels packed 2x2 into 64, an 8x VAE with Qwen-Image's
per-channel statistics, Qwen-Image's scheduler config), with no download:

* the tokenizer is a byte-level BPE built here whose merges make every word of the pipelines'
  prompt templates one token, as Qwen2.5's vocabulary does, so each template's system prefix is
  exactly the pipeline's `prompt_template_encode_start_idx` tokens (34, 64) and dropping them
  leaves the prompt (and the edit's image tokens), as with the real tokenizer;
* the edit processor: transformers 5.23's `Qwen2VLProcessor` cannot be built (nor loaded) without
  torchvision, because its `video_processor` is a required attribute and `Qwen2VLVideoProcessor`
  needs torchvision (`Qwen2VLProcessor(image_processor=..., tokenizer=..., video_processor=None)`
  raises AttributeError: `VIDEO_PROCESSOR_MAPPING` has no `_extra_content`). `ImageOnlyQwen2VLProcessor`
  below is the same class without the video attribute: same text expansion, same pixel_values and
  image_grid_thw (from `Qwen2VLImageProcessorPil`, the PIL/NumPy image processor that
  `Qwen2VLImageProcessor` falls back to here). The folder records the processor as the real ones
  do (`["transformers", "Qwen2VLProcessor"]`); load it with `load_qwen_image_edit` (which passes
  the processor in) where torchvision is missing.

`python -m tests.support.tiny_qwen` builds the three folders in a temporary directory, reloads them and
runs each pipeline at 32x32 for 2 steps."""

from __future__ import annotations

import itertools
import json
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from PIL import Image
from tokenizers import AddedToken
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
)

from server.demo.tokenizer import WORDS

# Qwen/Qwen-Image's scheduler/scheduler_config.json (Qwen-Image-Edit and -Edit-2509 publish the
# same): exponential time shift with mu from the packed image length, and the ladder stretched so
# its last sigma is 0.02.
QWEN_IMAGE_SCHEDULE = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

# Qwen2.5-VL's added tokens in their order (ids 151643..151656 there, 256 + merges.. here).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Splits text at the special tokens, as the tokenizer does before pre-tokenizing (picks vocabulary).
_SPECIAL = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

TEXT_HIDDEN = 32  # the VL model's width = the transformer's joint_attention_dim (3584 in the real one)
LATENT_CHANNELS = 16  # as Qwen-Image's VAE: the transformer takes 2x2 patches, 64 channels
# The VL image processor's pixel budget. Qwen2.5-VL's (and Qwen-Image-Edit's) preprocessor_config
# says min_pixels 3136, max_pixels 12845056: a 1024² edit image would be 1369 image tokens. Here at
# most 16 merged tokens (a 112² image: 8x8 patches of 14, merged 2x2), so the sequence stays short.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16
IMAGE_SIZE = 32


def _templates() -> list[tuple[str, int]]:
    """(prompt template, tokens its system prefix must be) of each pipeline, read from diffusers."""
    parts = dict(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    pipes = [
        QwenImagePipeline(**parts),
        QwenImageEditPipeline(**parts, processor=None),
        QwenImageEditPlusPipeline(**parts, processor=None),
    ]
    return [(p.prompt_template_encode, p.prompt_template_encode_start_idx) for p in pipes]


def _bpe(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """BPE on one pre-token: merge the best-ranked adjacent pair until none applies."""
    pieces = list(pieces)
    while len(pieces) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(itertools.pairwise(pieces)))
        if rank == len(ranks):
            break
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def byte_merges(words: list[str]) -> list[tuple[str, str]]:
    """Merges that make each (byte-level) word one token: whatever earlier merges leave, join left
    to right. Later merges rank after every earlier word's, so they never split one again."""
    merges: list[tuple[str, str]] = []
    for word in words:
        pieces = _bpe(list(word), {m: r for r, m in enumerate(merges)})
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            pieces[0:2] = [pieces[0] + pieces[1]]
    return merges


def _words(tokenizer: Qwen2Tokenizer, texts: list[str]) -> list[str]:
    """The byte-level pre-tokens of `texts` (special tokens split out first, as the tokenizer does)."""
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    words: dict[str, None] = {}
    for text in texts:
        for part in _SPECIAL.split(text):
            if part and part not in SPECIAL_TOKENS:
                words.update((w, None) for w, _ in pre.pre_tokenize_str(part))
    return [w for w in words if len(w) > 1]


def _qwen2_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Qwen2Tokenizer:
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",  # Qwen2.5-VL-Instruct's
        pad_token="<|endoftext|>",
        model_max_length=131072,  # Qwen2.5-VL's
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True
    )
    return tokenizer


def build_qwen_tokenizer() -> Qwen2Tokenizer:
    """Qwen2's byte-level BPE (its pre-tokenizer, NFC, byte-level decoder) over every byte, merges
    that make each word of the pipelines' templates and of the demo's captions one token, then
    Qwen2.5-VL's special tokens. Each template's system prefix is checked to be the pipeline's
    drop_idx tokens long."""
    alphabet = sorted(ByteLevel.alphabet())
    templates = _templates()
    texts = [t for t, _ in templates] + ["Picture 1: Picture 2: Picture 3: "]
    texts += [
        " ".join(WORDS),
        "\n".join(WORDS),
        "dance monkey, bad quality.\nmake it blue, turn the image into",
    ]
    plain = _qwen2_tokenizer({c: i for i, c in enumerate(alphabet)}, [])
    words = _words(plain, texts)
    merges = byte_merges(words)
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys([*alphabet, *(a + b for a, b in merges)]))}
    vocab.update({t: len(vocab) + i for i, t in enumerate(SPECIAL_TOKENS)})
    tokenizer = _qwen2_tokenizer(vocab, merges)

    split = [w for w in words if len(tokenizer.backend_tokenizer.model.tokenize(w)) != 1]
    if split:
        raise RuntimeError(f"the tokenizer splits {split[:5]}: the BPE merges are wrong")
    for template, drop_idx in templates:
        prefix = template[: template.index("user\n") + len("user\n")]
        if len(tokenizer(prefix).input_ids) != drop_idx:
            raise RuntimeError(f"the template's system prefix is not {drop_idx} tokens: {prefix!r}")
    return tokenizer


def _text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """Two layers of Qwen2.5-VL's language model (2 query heads of 16 sharing 1 key/value head, as
    the 7B's 28 share 4; M-RoPE sections in the 7B's 16:24:24 proportion) and of its vision tower
    (14-pixel patches, 2 frames, merged 2x2; block 1 full attention, block 0 windowed)."""
    ids = tokenizer.convert_tokens_to_ids
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 37,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    vision = {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": TEXT_HIDDEN,
        "fullatt_block_indexes": [1],
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "window_size": 112,
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _transformer(**extra: object) -> QwenImageTransformer2DModel:
    """Two double-stream blocks, 2 heads × 16; the rotary axes (frame, height, width) in the real
    model's 16:56:56 proportion, summing to the head size as they do to 128 there."""
    config = {
        "patch_size": 2,
        "in_channels": 4 * LATENT_CHANNELS,
        "out_channels": LATENT_CHANNELS,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": TEXT_HIDDEN,
        "guidance_embeds": False,
        "axes_dims_rope": (4, 6, 6),
    }
    return QwenImageTransformer2DModel(**{**config, **extra})


def _vae() -> AutoencoderKLQwenImage:
    """Qwen-Image's VAE shape (dim_mult 1,2,4,4: 8x spatial; 16 channels; its latents_mean and
    latents_std, the class defaults) at base width 4 instead of 96 and one residual block per level:
    the edit pipelines encode every condition image at ~1 megapixel, whatever the output size."""
    return AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without its video processor (the one part that needs torchvision):
    transformers reads a processor's parts from its `__init__` signature, so this one has two."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def build_qwen_processor(tokenizer: Qwen2Tokenizer) -> ImageOnlyQwen2VLProcessor:
    """Qwen2.5-VL's image preprocessing (14-pixel patches, 2 frames, merge 2, CLIP's mean and std)
    under a small pixel budget (MAX_PIXELS)."""
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def load_qwen_processor(folder: Path) -> ImageOnlyQwen2VLProcessor:
    """A saved processor folder (an edit pipeline's `processor/`), loaded without torchvision."""
    return ImageOnlyQwen2VLProcessor.from_pretrained(folder, local_files_only=True)


def build_qwen_image_edit_folder(folder: Path, plus: bool = False) -> Path:
    """Qwen-Image-Edit's folder (plus: Qwen-Image-Edit-2509's, `QwenImageEditPlusPipeline`): the
    text-to-image parts, the same transformer (the condition image's tokens join the sequence, no
    extra channels) and a processor. The processor is saved in `processor/` as the image-only
    class, then model_index.json records it as the real folders do, `Qwen2VLProcessor`."""
    torch.manual_seed(0)
    tokenizer = build_qwen_tokenizer()
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULE),
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=_transformer(),
        processor=build_qwen_processor(tokenizer),
    ).save_pretrained(folder, safe_serialization=True)
    _record_as_qwen2vl_processor(folder)
    return folder


def _record_as_qwen2vl_processor(folder: Path) -> None:
    """Name the processor `Qwen2VLProcessor` wherever it is recorded, as Qwen's folders do, and
    add the image processor's legacy `preprocessor_config.json` (transformers infers the video
    processor, `Qwen2VLVideoProcessor`, from it where no video config exists; that load needs
    torchvision and is not exercised here)."""
    _edit_json(
        folder / "model_index.json", lambda d: d.update(processor=["transformers", "Qwen2VLProcessor"])
    )
    for name in ("processor_config.json", "tokenizer_config.json"):
        _edit_json(folder / "processor" / name, lambda d: d.update(processor_class="Qwen2VLProcessor"))
    config = json.loads((folder / "processor" / "processor_config.json").read_text())
    legacy = {**config["image_processor"], "processor_class": "Qwen2VLProcessor"}
    (folder / "processor" / "preprocessor_config.json").write_text(json.dumps(legacy, indent=2) + "\n")


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_qwen_image_edit(folder: Path, plus: bool = False) -> DiffusionPipeline:
    """An edit folder as a pipeline where torchvision is missing (plain from_pretrained would load
    `Qwen2VLProcessor`, whose video processor needs it): the processor passed in."""
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return pipeline_class.from_pretrained(
        folder, processor=load_qwen_processor(folder / "processor"), local_files_only=True
    )


def condition_image(seed: int = 0, size: int = IMAGE_SIZE) -> Image.Image:
    """A random RGB image to edit."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _run(pipe: DiffusionPipeline, **extra: object) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    image = pipe(
        prompt="a red circle",
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        **extra,
    ).images
    seconds = time.perf_counter() - start
    print(f"{type(pipe).__name__}: {image.shape} std {image.std():.4f} ({seconds:.1f}s)")
    return image


def main() -> None:
    """Build, reload and run each folder: text to image with true CFG (a negative prompt, scale 4),
    the edits without (each condition image is ~4096 tokens at 1 MP), Edit-2509 with two images."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for plus in (False, True):
            folder = build_qwen_image_edit_folder(root / f"edit{int(plus)}", plus=plus)
            pipe = load_qwen_image_edit(folder, plus=plus)
            image = [condition_image(0), condition_image(1)] if plus else condition_image(0)
            _run(pipe, image=image, true_cfg_scale=1.0)


if __name__ == "__main__":
    main()
