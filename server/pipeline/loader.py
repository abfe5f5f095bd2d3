"""Load a Stable Diffusion-family folder (diffusers format), refusing anything unsafe or unknown.

Only safetensors weights are loaded: pickle files (`.bin`, `.ckpt`, ...) can run code when
unpickled, so a folder that has nothing else is refused with a message saying so. Every
check runs before any weight is read.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PIPELINES = {"StableDiffusionPipeline": "sd", "StableDiffusionXLPipeline": "sdxl"}
WEIGHTED = ("unet", "vae", "text_encoder", "text_encoder_2")
PICKLES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")


class ModelFolderError(ValueError):
    """A model folder that cannot be served; the message says what to fix."""


@dataclass
class Components:
    kind: str  # "sd" or "sdxl"
    folder: Path
    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: tuple[torch.nn.Module, ...]
    tokenizers: tuple[Any, ...]
    scheduler: Any  # the folder's own scheduler
    index: dict[str, Any] = field(default_factory=dict)  # model_index.json: pipeline options


def check_folder(folder: str | Path) -> dict[str, Any]:
    """The folder's model_index.json, once every component is known and has safetensors weights."""
    root = Path(folder)
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise ModelFolderError(f"{root} has no model_index.json: point it at a diffusers pipeline folder")
    try:
        index = json.loads(index_file.read_text())
    except json.JSONDecodeError as err:
        raise ModelFolderError(f"{index_file} is not valid JSON: {err}") from err
    kind = index.get("_class_name")
    if kind not in PIPELINES:
        raise ModelFolderError(f"{root} holds a {kind}; diffshard serves {', '.join(PIPELINES)}")
    for name in WEIGHTED:
        if not index.get(name) or index[name][0] is None:
            continue
        part = root / name
        if not part.is_dir():
            raise ModelFolderError(f"{root} lists {name} in model_index.json but has no {name}/ folder")
        if not any(part.glob("*.safetensors")):
            pickles = sorted(p.name for p in part.iterdir() if p.suffix in PICKLES)
            found = f"only pickle weights ({', '.join(pickles)})" if pickles else "no weights"
            raise ModelFolderError(
                f"{part} has {found}; diffshard loads safetensors only. Convert them, e.g. "
                f"load with diffusers and save_pretrained(..., safe_serialization=True)"
            )
    return index


def load_components(folder: str | Path, dtype: torch.dtype = torch.float32) -> Components:
    """Every component of the folder, on the CPU in `dtype` (weights), offline."""
    root = Path(folder)
    index = check_folder(root)

    def load(name: str) -> Any:
        library, class_name = index[name]
        cls = getattr(importlib.import_module(library), class_name)
        kwargs: dict[str, Any] = {}
        if name in WEIGHTED:  # diffusers and transformers name the dtype argument differently
            kwargs = (
                {"torch_dtype": dtype, "use_safetensors": True}
                if library == "diffusers"
                else {
                    "dtype": dtype,
                    "use_safetensors": True,
                }
            )
        return cls.from_pretrained(root / name, local_files_only=True, **kwargs)

    def present(*names: str) -> tuple[Any, ...]:
        return tuple(load(n) for n in names if index.get(n) and index[n][0] is not None)

    return Components(
        kind=PIPELINES[index["_class_name"]],
        folder=root,
        unet=load("unet").eval(),
        vae=load("vae").eval(),
        text_encoders=tuple(m.eval() for m in present("text_encoder", "text_encoder_2")),
        tokenizers=present("tokenizer", "tokenizer_2"),
        scheduler=load("scheduler"),
        index=index,
    )
