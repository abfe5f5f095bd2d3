"""Read a diffusers pipeline folder, refusing anything unsafe or unknown, then load its parts.

Only safetensors weights are loaded: pickle files (`.bin`, `.ckpt`, ...) can run code when
unpickled, so a folder that has nothing else is refused with a message saying so. Every
check runs, and the family is known, before any weight is read: each safetensors file's
header is opened (a truncated or corrupt file fails here, naming the file, not midway through
loading), and every class `model_index.json` names for a part diffshard loads must be a model,
tokenizer or scheduler class of diffusers or transformers (a folder is data: it must not pick
what gets imported, nor load a nested pipeline whose own index could).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers
from safetensors import safe_open

from server.engine.quantize import Quantization
from server.errors import ModelFolderError
from server.pipeline.families import Family, ModelConfig, family_class
from server.pipeline.loading import modular
from server.pipeline.loading.processors import stand_in_for
from server.pipeline.steps.schedulers import check_folder_scheduler

log = logging.getLogger("diffshard")

PICKLES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")
CLOSED_VOCABULARY = 1000  # tokens: a tokenizer this small knows its words only (CLIP's has 49408)
# The libraries a folder may name, already imported (nothing is imported by a name the folder
# gives, so neither the folder nor the working directory on sys.path can choose a module), and
# the classes each may give: loadable parts, never a pipeline (whose own model_index.json could
# name any library) nor any other attribute of the package.
LIBRARIES = {"diffusers": diffusers, "transformers": transformers}
# diffusers' pipeline packages whose own models a folder names by the package (["ltx2", "LTX2Vocoder"])
PIPELINE_MODULES = ("ltx2",)
ALLOWED_BASES: dict[str, tuple[type, ...]] = {
    "diffusers": (diffusers.ModelMixin, diffusers.SchedulerMixin),
    "transformers": (
        transformers.PreTrainedModel,
        transformers.PreTrainedTokenizerBase,
        transformers.ImageProcessingMixin,  # image-to-video's image processor: a config, no weights
    ),
}


def quiet_libraries() -> None:
    """Keep the libraries' chatter out of the service's log: transformers' progress bars and its
    notes on backends diffshard never uses (CLIPImageProcessor without torchvision), diffusers'
    progress bars. Their warnings about real problems still show (errors only for transformers,
    whose warnings here are all about optional backends), in the log's own format and naming
    their source (through the root logger, not a handler of their own)."""
    for library in (transformers, diffusers):
        library.utils.logging.disable_progress_bar()
        library.utils.logging.disable_default_handler()
        library.utils.logging.enable_propagation()
    transformers.utils.logging.set_verbosity_error()


def closed_vocabulary(tokenizers: tuple[Any, ...]) -> tuple[str, ...] | None:
    """The whole words a small, closed vocabulary knows (the built-in model's), in token order, to
    show users; None for a real tokenizer, which spells any word."""
    first = tokenizers[0] if tokenizers else None
    first = getattr(first, "tokenizer", first)  # a processor's (Qwen-Image 2.1's) tokenizer
    vocab = first.get_vocab() if first is not None else {}
    if not vocab or len(vocab) > CLOSED_VOCABULARY:
        return None
    tokens = sorted(vocab, key=vocab.__getitem__)  # by id: in the order the vocabulary was made
    words = (token.removesuffix("</w>") for token in tokens if token.endswith("</w>"))
    return tuple(word for word in words if len(word) > 1 and word.isalpha())


@dataclass
class Components:
    family: Family
    folder: Path
    denoiser: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: tuple[torch.nn.Module, ...]
    tokenizers: tuple[Any, ...]
    scheduler: Any  # the folder's own scheduler
    image_encoder: torch.nn.Module | None = None  # image-to-video's (families/wan.py: WanI2V)
    image_processor: Any = None
    more_experts: tuple[torch.nn.Module, ...] = ()  # the family's experts after the denoiser (Wan 2.2 A14B)
    sound_parts: tuple[torch.nn.Module, ...] = ()  # its audio's decoders (`Family.sound_parts`)
    # the parts whose quantization converts them on their device, as each piece is placed
    on_device: Mapping[str, Quantization] = field(default_factory=dict)

    @property
    def experts(self) -> tuple[torch.nn.Module, ...]:
        """Every denoiser, in `family.experts`' order."""
        return (self.denoiser, *self.more_experts)


def read_family(folder: str | Path) -> Family:
    """The folder's family, with its configs, once every part is known and has safetensors weights."""
    root = Path(folder)
    index, where = read_index(root)
    family = family_class(index)(ModelConfig(index, {}))
    if not _present(index, "scheduler") and family.default_scheduler() is None:
        raise ModelFolderError(f"{where} lists no scheduler: a {family.name} folder needs one")
    scheduler = index.get("scheduler")
    if isinstance(scheduler, list | tuple) and len(scheduler) == 2:  # else class_of says what is wrong
        check_folder_scheduler(str(scheduler[1]), family.folder_schedulers, family.pipeline_classes[0], where)
    for name in _loaded_parts(family):
        if _present(index, name):
            class_of(index, name)  # an unknown or disallowed class fails now, naming it
    for name in family.weighted:
        if not _present(index, name):
            if name in (family.denoiser, "vae"):
                raise ModelFolderError(f"{where} lists no {name}: a {family.name} folder needs one")
            continue
        part = root / name
        if not part.is_dir():
            raise ModelFolderError(f"{where} lists {name} but {root} has no {name}/ folder")
        if not any(part.glob("*.safetensors")):
            pickles = sorted(p.name for p in part.iterdir() if p.suffix in PICKLES)
            found = f"only pickle weights ({', '.join(pickles)})" if pickles else "no weights"
            raise ModelFolderError(
                f"{part} has {found}; diffshard loads safetensors only. Convert them, e.g. "
                f"load with diffusers and save_pretrained(..., safe_serialization=True)"
            )
        for file in sorted(part.glob("*.safetensors")):
            _check_header(file)
    denoiser = root / family.denoiser / "config.json"
    vae = root / "vae" / "config.json"
    hint = f"the folder's {family.denoiser}/ and vae/ need a config.json"
    config = {**_defaults(family.denoiser_class), **_read_json(denoiser, hint)}
    vae_config = {**_defaults(class_of(index, "vae")), **_read_json(vae, hint)}
    guider = root / "guider" / "guider_config.json"
    guider_config = (
        _read_json(guider, "its guider/ needs a guider_config.json") if _present(index, "guider") else {}
    )
    parts = {
        name: _read_json(root / name / "config.json", f"its {name}/ needs a config.json")
        for name in family.sound_parts
        if _present(index, name)
    }
    family = type(family)(ModelConfig(index, config, vae_config, guider_config, parts))
    family.check_configs(str(root))
    return family


def read_index(root: Path) -> tuple[dict[str, Any], str]:
    """The folder's index, and the file it was read from: `model_index.json`, else a modular
    pipeline's `modular_model_index.json` (read as the classic one: `loading/modular.py`)."""
    if (root / "model_index.json").is_file() or not (root / modular.INDEX).is_file():
        where = root / "model_index.json"
        return _read_json(where, "point it at a diffusers pipeline folder"), str(where)
    where = root / modular.INDEX
    return modular.classic_index(_read_json(where, "a modular pipeline folder needs one"), root), str(where)


def load_components(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    quantize: Mapping[str, Quantization] | None = None,
    denoiser_file: Path | None = None,
) -> Components:
    """Every part of the folder, on the CPU in `dtype` (weights), offline; the parts `quantize`
    names quantized (`server.pipeline.loading.quantized_parts`); the denoiser's weights from `denoiser_file`
    (a GGUF file, dequantized layer by layer as it runs) instead of the folder's."""
    root = Path(folder)
    family = read_family(root)
    index = family.config.index
    if denoiser_file is not None and len(family.experts) > 1:
        raise ModelFolderError(
            f"a GGUF file holds one denoiser; this folder has {len(family.experts)} experts: "
            "quantize them with --quantize instead"
        )

    def load(name: str) -> Any:
        library, cls = index[name][0], class_of(index, name)
        if name == family.denoiser and denoiser_file is not None:
            return load_gguf(cls, denoiser_file, root, name, dtype)
        kwargs: dict[str, Any] = {}
        if name in family.weighted:  # diffusers and transformers name the dtype argument differently
            dtype_arg = "torch_dtype" if library == "diffusers" else "dtype"
            kwargs = {dtype_arg: family.held_dtype(name, dtype), "use_safetensors": True}
        model = cls.from_pretrained(root / name, local_files_only=True, **kwargs)
        if (quantization := (quantize or {}).get(name)) and not quantization.on_device:
            converted = quantization.apply(model)
            log.info("%s: %d linear layers in %s", name, converted, quantization.mode)
        return model

    def present(names: tuple[str, ...]) -> tuple[Any, ...]:
        return tuple(load(n) for n in names if _present(index, n))

    return Components(
        family=family,
        folder=root,
        denoiser=load(family.denoiser).eval(),
        vae=load("vae").eval(),
        text_encoders=tuple(m.eval() for m in present(family.text_encoders)),
        tokenizers=present(family.tokenizers),
        scheduler=family.pipeline_scheduler(
            load("scheduler") if _present(index, "scheduler") else family.default_scheduler()
        ),
        image_encoder=next((m.eval() for m in present(family.image_encoders)), None),
        image_processor=next(iter(present(family.processors)), None),
        more_experts=tuple(load(name).eval() for name in family.experts[1:]),
        sound_parts=tuple(m.eval() for m in present(family.sound_parts)),
        on_device={name: q for name, q in (quantize or {}).items() if q.on_device},
    )


def load_gguf(cls: type, file: Path, folder: Path, name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A denoiser from a GGUF file (FLUX.1 users download Q8_0, Q5_K, Q4_K...) with the folder's
    config, through diffusers' `from_single_file`: its weights stay quantized and each layer
    dequantizes them to `dtype` when it runs."""
    from diffusers import GGUFQuantizationConfig

    return cls.from_single_file(
        str(file),
        config=str(folder),
        subfolder=name,
        quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
        torch_dtype=dtype,
        local_files_only=True,
    )


def gguf_tensor_bytes(file: Path) -> dict[str, int]:
    """Bytes each tensor of a GGUF file takes once loaded, read from its header and index (the
    file is memory-mapped: no weight is read)."""
    from gguf import GGUFReader

    try:
        return {t.name: int(t.n_bytes) for t in GGUFReader(file).tensors}
    except (OSError, ValueError, KeyError) as err:
        raise ModelFolderError(f"{file} is not a readable GGUF file: {err}") from err


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


def _loaded_parts(family: Family) -> tuple[str, ...]:
    """The parts `load_components` loads (others, such as a safety checker, are never imported)."""
    return (*family.weighted, *family.tokenizers, *family.processors, "scheduler")


def _check_header(file: Path) -> None:
    """Open the file's header: safetensors checks that it parses and that the tensors it lists
    cover the file exactly, so truncation and corruption show here, before any weight loads."""
    try:
        with safe_open(file, framework="pt") as weights:
            weights.keys()
    except Exception as err:  # SafetensorError (not exported as a class in every version), OSError
        raise ModelFolderError(f"{file} is corrupt or truncated: {err}") from err


def class_of(index: dict[str, Any], name: str) -> type:
    """The class the index names for part `name`: only a model, tokenizer or scheduler class
    of diffusers or transformers (`ALLOWED_BASES`)."""
    entry = index[name]
    if not (isinstance(entry, list | tuple) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
        raise ModelFolderError(f"model_index.json's {name} must be [library, class], got {entry!r}")
    library, class_name = entry
    named = f"model_index.json names {library}.{class_name} for {name}"
    if library in PIPELINE_MODULES:  # a part diffusers keeps beside its pipeline (LTX-2's connectors)
        module = importlib.import_module(f"diffusers.pipelines.{library}")
        library, found = "diffusers", getattr(module, class_name, None)
        if isinstance(found, type) and issubclass(found, diffusers.ModelMixin):
            return found
        raise ModelFolderError(f"{named}, which is not a model diffusers' {entry[0]} pipeline has")
    if library not in LIBRARIES:
        raise ModelFolderError(f"{named}; diffshard loads classes from {' and '.join(LIBRARIES)} only")
    if library == "transformers" and (stand_in := stand_in_for(class_name, name)) is not None:
        return stand_in  # a processor transformers cannot build without torchvision (processors.py)
    found = None
    if class_name.isidentifier() and not class_name.startswith("_"):
        try:  # the packages are lazy: an attribute may import one of their own submodules
            found = getattr(LIBRARIES[library], class_name, None)
        except (ImportError, RuntimeError):  # a class whose optional dependency is missing
            found = None
    if not isinstance(found, type):
        raise ModelFolderError(f"{named}, which is not a class {library} has")
    if missing := getattr(found, "_backends", None):  # a stand-in for a class whose packages are missing
        install = " ".join(name for name in missing if name != "torch")
        raise ModelFolderError(f"{named}, which needs what diffshard does not install: pip install {install}")
    if not issubclass(found, ALLOWED_BASES[library]):
        kinds = ", ".join(base.__name__ for base in ALLOWED_BASES[library])
        raise ModelFolderError(f"{named}, which is not a part diffshard loads (a subclass of {kinds})")
    return found


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
