"""`--quantize`: which of a model's parts are quantized, in which mode, and the bytes that leaves.

The setting is a mode alone (`int8`: the denoiser, and every text encoder over 1 GiB, such as
FLUX.1's and SD3's T5-XXL) or per part (`denoiser=int8-dynamic,text_encoder_2=int8`). The
denoiser keeps its family's `keep_precise` layers (a DiT's projections in and its output head,
as Nunchaku keeps them) in the model's dtype: a sliver of its bytes. Most modes convert while
loading, on the CPU; float8 converts where the weights then live: the denoiser block by block as
it is placed (`placing`), the text encoders piece by piece as placed (`parts.place_parts`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from server.engine import layout_of
from server.engine.planning.plan import count_block_bytes
from server.engine.quantize import Quantization, QuantMode
from server.engine.runtime.compile import CompileMode
from server.pipeline.families import Family
from server.pipeline.loading.folder import Components, part_bytes

EVERY_LARGE_PART = "*"  # a mode given alone
LARGE_ENCODER = 2**30  # bytes: a text encoder a mode given alone quantizes
DENOISER = "denoiser"

QuantizeSetting = dict[str, QuantMode]


def parse_quantize(value: object) -> QuantizeSetting:
    """`off`, a mode, or PART=MODE,... → {part or "*": mode}; a bad entry names what to write."""
    if isinstance(value, Mapping):
        return {str(part): QuantMode(mode) for part, mode in value.items()}
    modes = ", ".join(m.value for m in QuantMode)
    text = str(value or "off").strip()
    if "=" not in text:
        try:
            mode = QuantMode(text)
        except ValueError:
            raise ValueError(f"write a mode ({modes}) or PART=MODE,..., got {text!r}") from None
        return {} if mode == QuantMode.OFF else {EVERY_LARGE_PART: mode}
    setting: QuantizeSetting = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        part, _, mode = (s.strip() for s in entry.partition("="))
        if mode not in set(QuantMode) or not part:
            raise ValueError(f"write PART=MODE with a mode of {modes}, got {entry!r}")
        if part in setting:
            raise ValueError(f"{part} is given twice")
        setting[part] = QuantMode(mode)
    return {part: mode for part, mode in setting.items() if mode != QuantMode.OFF}


def describe(setting: str | QuantizeSetting, denoiser_file: Path | None = None) -> str:
    """What /v1/models, the metrics and the playground say is served: the setting as users write
    it (`off`, `int8`, `denoiser=int8,text_encoder_2=int8`), and a GGUF denoiser's file."""
    setting = parse_quantize(setting)
    written = [f"{part}={mode}" if part != EVERY_LARGE_PART else str(mode) for part, mode in setting.items()]
    if denoiser_file is not None:
        written.append(f"denoiser=gguf:{denoiser_file.name}")
    return ",".join(written) or "off"


def float8_speed(setting: QuantizeSetting, compile_mode: str) -> str | None:
    """What float8 gives the denoiser's steps, said at startup. torchao scales each activation in
    kernels of its own, which only a compiled graph fuses: eagerly, float8 steps were slower than
    bfloat16's on every GPU measured (an H200: FLUX.1-dev 1.58x, SDXL 6.24x, Wan 1.23x), a memory
    choice; compiled, FLUX.1-dev's ran 0.65x bfloat16's eager step there."""
    if setting.get(DENOISER, setting.get(EVERY_LARGE_PART)) != QuantMode.FLOAT8:
        return None
    if compile_mode.endswith(CompileMode.OFF):
        return (
            "--quantize float8 with --compile off: a memory choice (its weights take half the bytes, but "
            "its steps run slower than bfloat16's eagerly); --compile auto fuses its scaling"
        )
    return (
        "--quantize float8: its steps compiled, each bucket kept where faster than eager "
        "(/v1/stats: compile.buckets); until then it is a memory choice, slower than bfloat16 eagerly"
    )


def check_parts(setting: QuantizeSetting, family: Family) -> None:
    """Every part the setting names is one the family quantizes: the denoiser or a text encoder."""
    known = (DENOISER, *family.text_encoders)
    for part in setting:
        if part not in (EVERY_LARGE_PART, *known):
            names = ", ".join(known)
            raise ValueError(f"{part!r} is not a part of a {family.name} model: name one of {names}")


def part_quantizations(
    setting: QuantizeSetting, family: Family, encoder_bytes: Mapping[str, int]
) -> dict[str, Quantization]:
    """Per folder part (the denoiser under its folder name), its quantization; `encoder_bytes`
    (each text encoder's unquantized bytes) decides which encoders a mode given alone takes."""
    alone = setting.get(EVERY_LARGE_PART)
    out: dict[str, Quantization] = {}
    if mode := setting.get(DENOISER, alone):  # every expert of a family with two (Wan 2.2 A14B)
        out.update((name, Quantization(mode, family.keep_precise)) for name in family.experts)
    for name, nbytes in encoder_bytes.items():
        mode = setting.get(name, alone if nbytes > LARGE_ENCODER else None)
        if mode:
            out[name] = Quantization(mode)
    return out


def folder_quantizations(
    setting: QuantizeSetting, family: Family, folder: Path, dtype: torch.dtype
) -> dict[str, Quantization]:
    """`part_quantizations` for a folder's parts, sized from their safetensors headers."""
    index = family.config.index
    present = [n for n in family.text_encoders if index.get(n) and index[n][0] is not None]
    return part_quantizations(setting, family, {n: part_bytes(folder, (n,), dtype) for n in present})


def load_quantizations(
    setting: str | QuantizeSetting,
    family: Family,
    folder: Path,
    dtype: torch.dtype,
    denoiser_file: Path | None,
) -> dict[str, Quantization]:
    """`folder_quantizations`, less the denoiser when a GGUF file (quantized already) holds it."""
    quantizations = folder_quantizations(parse_quantize(setting), family, folder, dtype)
    if denoiser_file is not None:
        quantizations.pop(family.denoiser, None)
    return quantizations


def placed_in_groups(quantizations: Mapping[str, Quantization], family: Family) -> dict[str, Quantization]:
    """A tensor group's: the denoisers' modes convert each rank's blocks as they are placed, so
    a rank's share of a layer is cut from the float weights before it is quantized."""
    return {
        name: replace(q, when_placed=True) if name in family.experts else q
        for name, q in quantizations.items()
    }


def placing(
    quantizations: Mapping[str, Quantization], components: Components, expert: int = 0
) -> Callable[[nn.Module, str], int] | None:
    """What converts the loaded denoiser's (`expert`'s) blocks as they are placed (ModelShard's
    `placed`), where its mode quantizes on the device (float8: torchao converts on the GPU only);
    None: converted while loading, or not at all."""
    quantization = quantizations.get(components.family.experts[expert])
    model = components.experts[expert]
    return quantization.placing(model) if quantization and quantization.on_device else None


def held_bytes(
    denoiser: nn.Module, dtype: torch.dtype, quantization: Quantization | None, denoiser_file: Path | None
) -> dict[str, int] | None:
    """What each block of a loaded denoiser holds, quantized (counted from shapes: float8 is
    converted only once placed) or from a GGUF file (as loaded); None when neither."""
    if denoiser_file is not None:
        return count_block_bytes(denoiser, layout_of(denoiser), None)
    if quantization is not None:
        return count_block_bytes(denoiser, layout_of(denoiser), dtype, quantization)
    return None


def quantized_bytes(model: nn.Module, quantization: Quantization | None, dtype: torch.dtype) -> int:
    """Bytes `model` (on the meta device will do) holds in `dtype` under `quantization`."""
    return (quantization or Quantization()).bytes(model, dtype)


def meta_part(folder: Path, name: str, cls: type) -> nn.Module:
    """A folder part built from its config on the meta device: its shapes, no weights."""
    path = folder / name
    with torch.device("meta"):
        if hasattr(cls, "config_class"):  # transformers
            return cls(cls.config_class.from_pretrained(path))
        return cls.from_config(cls.load_config(path))
