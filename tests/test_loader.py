"""Loading diffusers folders: the built-in model loads; pickle-only, damaged or unknown folders,
and classes from anywhere but diffusers and transformers, do not."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from server.demo import MODEL_DIR
from server.errors import ModelFolderError
from server.pipeline.loading.folder import load_components, read_family


def test_built_in_model_loads_every_component_in_the_asked_dtype() -> None:
    parts = load_components(MODEL_DIR, dtype=torch.bfloat16)
    assert parts.family.name == "sd" and len(parts.text_encoders) == 1 and len(parts.tokenizers) == 1
    assert next(parts.denoiser.parameters()).dtype == torch.bfloat16
    assert next(parts.text_encoders[0].parameters()).dtype == torch.bfloat16
    assert type(parts.scheduler).__name__ == "DDIMScheduler"


@pytest.fixture
def folder_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(MODEL_DIR, copy)
    return copy


def test_pickle_only_weights_are_refused_with_the_reason(folder_copy: Path) -> None:
    weights = folder_copy / "unet" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(weights), folder_copy / "unet" / "diffusion_pytorch_model.bin")
    weights.unlink()
    with pytest.raises(
        ModelFolderError, match=r"unet has only pickle weights \(diffusion_pytorch_model.bin\)"
    ):
        load_components(folder_copy)


def test_missing_index_unknown_pipeline_and_missing_part(folder_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match=r"no model_index\.json"):
        load_components(tmp_path)
    index = json.loads((folder_copy / "model_index.json").read_text())
    (folder_copy / "model_index.json").write_text(json.dumps(index | {"_class_name": "HunyuanImagePipeline"}))
    with pytest.raises(ModelFolderError, match="holds a HunyuanImagePipeline"):
        load_components(folder_copy)
    (folder_copy / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(folder_copy / "vae")
    with pytest.raises(ModelFolderError, match="no vae/ folder"):
        load_components(folder_copy)


def test_configs_that_rely_on_class_defaults_get_them(folder_copy: Path) -> None:
    """Older SD folders leave keys such as the VAE's scaling_factor to AutoencoderKL's defaults."""
    config = folder_copy / "vae" / "config.json"
    config.write_text(
        json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "scaling_factor"})
    )
    family = read_family(folder_copy)
    assert family.config.vae["scaling_factor"] == 0.18215  # AutoencoderKL's default
    assert family.vae_scale_factor == 4 and family.native_size == 64


def test_a_truncated_or_corrupt_weights_file_is_named_at_validation(folder_copy: Path) -> None:
    weights = folder_copy / "vae" / "diffusion_pytorch_model.safetensors"
    with weights.open("r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    with pytest.raises(ModelFolderError, match=rf"{re.escape(str(weights))} is corrupt or truncated"):
        read_family(folder_copy)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ModelFolderError, match="corrupt or truncated"):
        read_family(folder_copy)


@pytest.mark.parametrize(
    ("part", "entry", "words"),
    [
        ("unet", ["diffusers", "NoSuchUNet"], "diffusers.NoSuchUNet for unet, which is not a class"),
        (
            "vae",
            ["os", "system"],
            "os.system for vae; diffshard loads classes from diffusers and transformers",
        ),
        ("tokenizer", ["server", "Settings"], "server.Settings for tokenizer; diffshard loads classes from"),
        ("unet", ["diffusers", "StableDiffusionPipeline"], "which is not a part diffshard loads"),
        ("scheduler", ["diffusers", "utils"], "names utils, a scheduler diffshard does not step"),
        ("text_encoder", ["diffusers", "utils"], "diffusers.utils for text_encoder, which is not a class"),
        ("text_encoder", ["transformers", "__class__"], "which is not a class"),
        ("vae", "AutoencoderKL", "must be \\[library, class\\]"),
    ],
)
def test_only_parts_of_diffusers_and_transformers_are_loaded(
    folder_copy: Path, part: str, entry: object, words: str
) -> None:
    """A folder is data: the classes it names are checked when it is validated (before the port
    listens), and only model, tokenizer and scheduler classes of the two libraries pass."""
    index = json.loads((folder_copy / "model_index.json").read_text())
    (folder_copy / "model_index.json").write_text(json.dumps(index | {part: entry}))
    with pytest.raises(ModelFolderError, match=words):
        read_family(folder_copy)


# diffusers classes that stand in for themselves when their package is missing, with that package
# (scipy comes with the peers extra: NNCF needs it)
NEEDS_A_PACKAGE = (
    ("LMSDiscreteScheduler", "scipy"),
    ("DPMSolverSDEScheduler", "torchsde"),
    ("MidiProcessor", "note_seq"),
)


def test_a_class_whose_package_is_missing_names_what_to_install(folder_copy: Path) -> None:
    """diffusers exports a stand-in where a class's optional package is not installed: the folder
    is refused before the port listens, naming the package, not with an import error mid-load."""
    missing = [
        (name, package) for name, package in NEEDS_A_PACKAGE if importlib.util.find_spec(package) is None
    ]
    if not missing:
        pytest.skip(f"every package of {NEEDS_A_PACKAGE} is installed here")
    class_name, package = missing[0]
    index = json.loads((folder_copy / "model_index.json").read_text())
    (folder_copy / "model_index.json").write_text(json.dumps(index | {"vae": ["diffusers", class_name]}))
    with pytest.raises(ModelFolderError, match=f"does not install: pip install {package}$"):
        read_family(folder_copy)


def test_parts_that_are_never_loaded_may_name_other_libraries(folder_copy: Path) -> None:
    """Real SD-1.5 folders list a safety checker from diffusers' pipeline modules; it is never
    imported, so it is not refused."""
    index = json.loads((folder_copy / "model_index.json").read_text())
    extra = {"safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"]}
    (folder_copy / "model_index.json").write_text(json.dumps(index | extra))
    assert read_family(folder_copy).name == "sd"
