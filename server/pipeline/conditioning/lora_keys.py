"""Reading LoRA files for a model's parts (`adapters.py` applies them per row): diffusers' own
loaders (`lora_state_dict`: diffusers/PEFT keys, and kohya's A1111 format converted),
safetensors only; each part's pairs with their alphas (network alphas, or PEFT's metadata)."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
)
from safetensors import safe_open
from safetensors.torch import load_file

from server.errors import ModelFolderError
from server.pipeline.conditioning.adapters import Adapter, LoraPair
from server.pipeline.families import Family


def read_adapter(name: str, path: Path, family: Family) -> Adapter:
    """`path` (a .safetensors file) as an Adapter for a model of `family`, read by its diffusers
    pipeline class's `lora_state_dict`; ModelFolderError says what does not fit."""
    pipeline_class = getattr(diffusers, family.pipeline_classes[0])
    parts = (*family.experts, *family.text_encoders)
    if path.suffix != ".safetensors" or not path.is_file():
        raise ModelFolderError(f"LoRA {name!r}: {path} is not a .safetensors file")
    raw = load_file(path)
    with safe_open(path, "pt") as header:
        metadata = json.loads((header.metadata() or {}).get("lora_adapter_metadata", "{}") or "{}")
    # A later expert's keys (Wan 2.2 A14B's `transformer_2.`) are read as the first's, then put back
    # under its name: what diffusers' load_lora_weights(..., load_into_transformer_2=True) loads.
    state: dict[str, Any] = {}
    alphas: dict[str, Any] = {}
    for expert, keys in _by_expert(raw, family).items():
        read, read_alphas = _lora_state(pipeline_class, keys)
        state.update(_renamed(read, family.denoiser, expert))
        alphas.update(_renamed(read_alphas or {}, family.denoiser, expert))
    adapter = Adapter(name, path)
    by_part: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        part, _, inner = key.partition(".")
        if part not in parts or not inner:
            raise ModelFolderError(
                f"LoRA {name!r}: {path.name} targets {key!r}, which is not a part of this model "
                f"({', '.join(parts)})"
            )
        by_part.setdefault(part, {})[inner] = tensor
    for part, tensors in by_part.items():
        text = part not in family.experts
        part_alphas = {k.removeprefix(f"{part}."): v for k, v in alphas.items() if k.startswith(f"{part}.")}
        pairs = _pairs(_as_peft(tensors, text), f"LoRA {name!r}: {path.name}")
        module_alphas = _alphas_by_module(part_alphas, text, pairs)
        config = _part_config(metadata, part)
        rslora = bool(config.get("use_rslora", False))
        for module, pair in pairs.items():
            if set(pair) != {"down", "up"}:
                raise ModelFolderError(f"LoRA {name!r}: {path.name} has half of a pair at {part}.{module}")
            rank = pair["down"].shape[0]
            alpha = module_alphas.get(module)
            if alpha is None:
                alpha = _configured_alpha(config, module, rank)
            adapter.parts.setdefault(part, {})[module] = LoraPair(
                pair["down"], pair["up"], float(alpha), rslora
            )
    if not adapter.parts:
        raise ModelFolderError(f"LoRA {name!r}: {path.name} holds no LoRA weights")
    return adapter


def _lora_state(pipeline_class: type, raw: dict[str, torch.Tensor]) -> tuple[dict[str, Any], Any]:
    """(state, network alphas) as the pipeline class's `lora_state_dict` reads `raw`: FLUX's
    loader pops `.alpha` keys and drops them unless asked to return them, as its load_lora_weights
    asks; SD and SDXL's always give (state, network alphas); SD3's, the state."""
    if not raw:
        return {}, None
    asks = "return_alphas" in inspect.signature(pipeline_class.lora_state_dict).parameters
    read = pipeline_class.lora_state_dict(raw, **({"return_alphas": True} if asks else {}))
    return read if isinstance(read, tuple) else (read, None)


def _by_expert(raw: dict[str, torch.Tensor], family: Family) -> dict[str, dict[str, torch.Tensor]]:
    """The file's keys per expert, a later expert's renamed as the first's (the rest: the first's)."""
    later = {
        e: _renamed({k: v for k, v in raw.items() if k.startswith(f"{e}.")}, e, family.denoiser)
        for e in family.experts[1:]
    }
    taken = {f"{e}." for e in later}
    first = {k: v for k, v in raw.items() if not k.startswith(tuple(taken))}
    return {e: keys for e, keys in {family.denoiser: first, **later}.items() if keys}


def _renamed(keys: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """`keys` with the part prefix `old.` made `new.`."""
    return {(new + k.removeprefix(old) if k.startswith(f"{old}.") else k): v for k, v in keys.items()}


def _part_config(metadata: dict[str, Any], part: str) -> dict[str, Any]:
    """A part's peft config from diffusers' `lora_adapter_metadata`: `save_lora_weights` prefixes
    each key with its part (`unet.lora_alpha`, `text_encoder.alpha_pattern`); a file written for
    one model alone may hold them bare."""
    prefixed = {k.removeprefix(f"{part}."): v for k, v in metadata.items() if k.startswith(f"{part}.")}
    return prefixed or {k: v for k, v in metadata.items() if "." not in k}


def _configured_alpha(config: dict[str, Any], module: str, rank: int) -> float:
    """The module's lora_alpha as peft reads a LoraConfig: its `alpha_pattern` entry (a key that
    matches the module name's tail, as peft's `get_pattern_key`), else `lora_alpha`, else the rank
    (the scaling is then 1)."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config.get("lora_alpha", rank))


def _as_peft(tensors: dict[str, Any], text: bool) -> dict[str, Any]:
    """A part's keys in PEFT's form (`<module>.lora_A.weight`), converted as diffusers' loaders do
    (older diffusers and kohya-converted keys: `processor.to_k_lora.down.weight`, ...)."""
    if all(".lora_A." in key or ".lora_B." in key for key in tensors):
        return tensors
    if text:
        return convert_state_dict_to_peft(convert_state_dict_to_diffusers(tensors))
    return convert_unet_state_dict_to_peft(tensors)


def _alphas_by_module(alphas: dict[str, Any], text: bool, modules: Mapping[str, Any]) -> dict[str, Any]:
    """Alphas by module: FLUX's `<module>.alpha` name a module already (PEFT form); kohya's (keyed
    by the converted down weight + `.alpha`) go through the same conversion as the weights'."""
    direct = {k.removesuffix(".alpha"): v for k, v in alphas.items() if k.removesuffix(".alpha") in modules}
    kohya = {k: v for k, v in alphas.items() if k.removesuffix(".alpha") not in modules}
    weights = [key.removesuffix(".alpha") for key in kohya]
    converted = _as_peft(dict.fromkeys(weights, 0), text)
    by_module = {key.split(".lora_")[0]: a for key, a in zip(converted, kohya.values(), strict=True)}
    return by_module | direct


def _pairs(tensors: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """PEFT-form tensors by module: {"down": lora_A, "up": lora_B}; `where` names the file."""
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.partition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ModelFolderError(f"{where} has a key diffshard cannot read: {key}")
        pairs.setdefault(module, {})["down" if kind == "A.weight" else "up"] = tensor
    return pairs
