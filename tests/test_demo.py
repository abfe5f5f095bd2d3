"""The built-in model: dataset, tokenizer, a --quick training run, and the committed folder."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline

from server.demo import MODEL_DIR
from server.demo.dataset import COLORS, SHAPES, sample_batch
from server.demo.sampling import generate, load_pipeline, recommended, score
from server.demo.tokenizer import WORDS, build_tokenizer
from server.demo.train import QUICK
from tests.support.forking import Forked


def test_dataset_is_reproducible_and_covers_every_combination() -> None:
    a = sample_batch(600, torch.Generator().manual_seed(3))
    b = sample_batch(600, torch.Generator().manual_seed(3))
    assert torch.equal(a.images, b.images) and a.captions == b.captions
    assert a.images.shape == (600, 3, 64, 64)
    assert a.images.min() >= -1 and a.images.max() <= 1
    assert {(c, s) for c, s in zip(a.colors, a.shapes, strict=True)} == {
        (c, s) for c in COLORS for s in SHAPES
    }
    assert a.captions[0] == f"a {a.colors[0]} {a.shapes[0]}"


def test_tokenizer_makes_each_dataset_word_one_token() -> None:
    tokenizer = build_tokenizer()
    assert tokenizer.model_max_length == 77
    for word in WORDS:
        assert len(tokenizer.tokenize(word)) == 1, word
    ids = tokenizer("a purple triangle", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and ids[0] == tokenizer.bos_token_id and ids[4] == tokenizer.eos_token_id
    assert tokenizer.tokenize("a big red circle")[-2:] == [
        "red</w>",
        "circle</w>",
    ]  # unknown words still split


@pytest.mark.slow
def test_quick_training_writes_a_standard_pipeline_folder(tmp_path: Path, forked: Forked) -> None:
    """`python -m server.demo.train --quick` (a process of its own, forked: conftest's Forked),
    its step counts overridden to 3 (the fewest its one-cycle schedules take): every phase runs
    and saves; what the folder holds does not depend on how long each phase trained."""
    out = tmp_path / "model"
    args = ["--quick", "--vae-steps", "3", "--unet-steps", "3", "--out", str(out)]
    done = forked.run("server.demo.train", *args, timeout_s=600)
    assert done.returncode == 0, done.stderr[-2000:]
    logged = [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]
    assert logged[-1]["phase"] == "done" and {"vae", "latents", "unet"} <= {e["phase"] for e in logged}
    assert logged[-1]["budget"] == asdict(QUICK) | {"vae_steps": 3, "unet_steps": 3}
    assert_standard_folder(out)
    pipe = StableDiffusionPipeline.from_pretrained(out, local_files_only=True)
    image = pipe("a red circle", num_inference_steps=2, height=64, width=64).images[0]
    assert image.size == (64, 64)


def assert_standard_folder(folder: Path) -> None:
    for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (folder / part).is_dir(), part
    weights = [p.name for p in folder.rglob("*") if p.suffix in {".safetensors", ".bin", ".ckpt", ".pt"}]
    assert weights and all(name.endswith(".safetensors") for name in weights)
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"


def test_committed_model_is_a_small_standard_folder() -> None:
    assert_standard_folder(MODEL_DIR)
    size = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert size < 25 * 2**20
    settings = recommended()
    assert {"num_inference_steps", "guidance_scale", "scheduler"} <= set(settings)


@pytest.fixture(scope="module")
def pipe() -> StableDiffusionPipeline:
    return load_pipeline()


def test_diffusers_loads_the_committed_model_and_seeds_reproduce(pipe: StableDiffusionPipeline) -> None:
    a = generate(pipe, ["a green square"], [7], steps=10, guidance=5.0)[0]
    b = generate(pipe, ["a green square"], [7], steps=10, guidance=5.0)[0]
    assert a.size == (64, 64) and a.tobytes() == b.tobytes()


@pytest.mark.slow
def test_images_follow_the_prompt(pipe: StableDiffusionPipeline) -> None:
    """diffusers' own pipeline, 64x64, 25 steps, guidance 5, the folder's (DDIM) scheduler."""
    result = score(pipe, seeds=[0, 1, 2, 3], steps=25, guidance=5.0)["summary"]
    assert result["scheduler"] == "DDIMScheduler" and result["images"] == 72
    assert result["color_accuracy"] >= 0.90, result
    assert result["shape_accuracy"] >= 0.80, result
