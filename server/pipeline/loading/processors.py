"""Processors the published folders name that transformers cannot build here, and what loads in
their place. transformers 5 builds a processor from every part its `__init__` names, and the
image and video halves of Mistral's and Qwen2-VL's need torchvision, which PyPI's builds do not
pair with our CPU torch ("operator torchvision::nms does not exist"). What the pipelines use of
them needs no torchvision:

- FLUX.2 [dev]'s `PixtralProcessor` and FLUX.3's `Qwen3VLProcessor`, each its tokenizer: text
  prompts only use its tokenizer and chat template (`TextTokenizer`);
- Qwen-Image-Edit's `Qwen2VLProcessor` and Qwen-Image 2.1's `Qwen3VLProcessor`: their tokenizer
  and image processor, whose PIL/NumPy implementation (`Qwen2VLImageProcessorPil`, what
  `Qwen2VLImageProcessor` falls back to without torchvision) gives the same `pixel_values` and
  `image_grid_thw`; never their video processor (`ImageQwen2VLProcessor`, `ImageQwen3VLProcessor`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers
from transformers import Qwen2VLProcessor, Qwen3VLProcessor


class TextTokenizer:
    """The text half of a processor a pipeline names as its tokenizer: the tokenizer saved in the
    folder, with the processor's chat template (older processors keep it in chat_template.json)."""

    @staticmethod
    def from_pretrained(folder: Path, **kwargs: Any) -> Any:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
        template = Path(folder) / "chat_template.json"
        if tokenizer.chat_template is None and template.is_file():
            tokenizer.chat_template = json.loads(template.read_text())["chat_template"]
        return tokenizer


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without its video processor: transformers reads a processor's parts from
    its `__init__`, so this one has two (tokenizer, image processor) and loads from a Qwen folder."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
    ):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageQwen3VLProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without its video processor, as `ImageQwen2VLProcessor`."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
    ):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


IMAGE_STAND_INS = {"Qwen2VLProcessor": ImageQwen2VLProcessor, "Qwen3VLProcessor": ImageQwen3VLProcessor}


def stand_in_for(class_name: str, part: str) -> type | None:
    """What loads in place of the processor class `class_name` named for `part`, if anything."""
    if class_name in IMAGE_STAND_INS and not part.startswith("tokenizer"):
        return IMAGE_STAND_INS[class_name]
    if class_name.endswith("Processor") and part.startswith("tokenizer"):
        return TextTokenizer
    return None
