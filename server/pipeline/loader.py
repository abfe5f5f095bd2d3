"""Read a diffusers pipeline folder, refusing anything unsafe or unknown, then load its parts.

Only safetensors weights are loaded: pickle files (`.bin`, `.ckpt`, ...) can run code when
unpickled, so a folder that has nothing else is refused with a message saying so. Every
check runs, and the family is known, before any weight is read.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from server.errors import ModelFolderError
from server.pipeline.families import Family, ModelConfig, family_class

PICKLES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")


@dataclass
class Components:
    family: Family
    folder: Path
    denoiser: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: tuple[torch.nn.Module, ...]
    tokenizers: tuple[Any, ...]
    scheduler: Any  # the folder's own scheduler


def read_family(folder: str | Path) -> Family:
    """The folder's family, with its configs, once every part is known and has safetensors weights."""
    root = Path(folder)
    index = _read_json(root / "model_index.json", "point it at a diffusers pipeline folder")
    family = family_class(index)(ModelConfig(index, {}))
    for name in family.weighted:
        if not _present(index, name):
            if name in (family.denoiser, "vae"):
                raise ModelFolderError(
                    f"{root}/model_index.json lists no {name}: a {family.name} folder needs one"
                )
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
    denoiser = root / family.denoiser / "config.json"
    vae = root / "vae" / "config.json"
    hint = f"the folder's {family.denoiser}/ and vae/ need a config.json"
    config = {**_defaults(family.denoiser_class), **_read_json(denoiser, hint)}
    vae_config = {**_defaults(_class_of(index, "vae")), **_read_json(vae, hint)}
    return type(family)(ModelConfig(index, config, vae_config))


def load_components(folder: str | Path, dtype: torch.dtype = torch.float32) -> Components:
    """Every part of the folder, on the CPU in `dtype` (weights), offline."""
    root = Path(folder)
    family = read_family(root)
    index = family.config.index

    def load(name: str) -> Any:
        library, cls = index[name][0], _class_of(index, name)
        kwargs: dict[str, Any] = {}
        if name in family.weighted:  # diffusers and transformers name the dtype argument differently
            dtype_arg = "torch_dtype" if library == "diffusers" else "dtype"
            kwargs = {dtype_arg: dtype, "use_safetensors": True}
        return cls.from_pretrained(root / name, local_files_only=True, **kwargs)

    def present(names: tuple[str, ...]) -> tuple[Any, ...]:
        return tuple(load(n) for n in names if _present(index, n))

    return Components(
        family=family,
        folder=root,
        denoiser=load(family.denoiser).eval(),
        vae=load("vae").eval(),
        text_encoders=tuple(m.eval() for m in present(family.text_encoders)),
        tokenizers=present(family.tokenizers),
        scheduler=load("scheduler"),
    )


def part_bytes(folder: str | Path, names: tuple[str, ...], dtype: torch.dtype) -> int:
    """Bytes the named parts take once loaded in `dtype`, read from safetensors headers only."""
    total = 0
    for name in names:
        for file in sorted((Path(folder) / name).glob("*.safetensors")):
            with safe_open(file, framework="pt") as weights:
                for key in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensor = weights.get_slice(key)
                    numel = 1
                    for side in tensor.get_shape():
                        numel *= side
                    floating = tensor.get_dtype().startswith(("F", "BF"))
                    total += numel * (dtype.itemsize if floating else _ITEMSIZE.get(tensor.get_dtype(), 8))
    return total


_ITEMSIZE = {"I8": 1, "U8": 1, "BOOL": 1, "I16": 2, "I32": 4, "I64": 8}


def _class_of(index: dict[str, Any], name: str) -> type:
    library, class_name = index[name]
    try:
        return getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError) as err:
        raise ModelFolderError(
            f"model_index.json names {library}.{class_name} for {name}, which is unknown"
        ) from err


def _defaults(cls: type) -> dict[str, Any]:
    """A diffusers model's config keys with their defaults: the parameters of its __init__."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _present(index: dict[str, Any], name: str) -> bool:
    entry = index.get(name)
    return bool(entry) and entry[0] is not None


def _read_json(path: Path, hint: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelFolderError(f"{path.parent} has no {path.name}: {hint}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelFolderError(f"{path} is not valid JSON: {err}") from err
