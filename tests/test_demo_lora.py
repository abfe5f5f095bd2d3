"""The committed diamond adapter (issue 23: a real adapter, trained here by
`python -m server.demo.train_lora`), served as the server serves it: read by `read_adapter`
into the built-in pipeline, asked for by a request. Diamonds come out in the asked colour; a
request without it is the base model's, bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from server.demo import MODEL_DIR
from server.demo.dataset import COLORS, SHAPES, caption, sample_batch
from server.demo.evaluate import Verdict, classify
from server.demo.tokenizer import WORDS
from server.demo.train_lora import ADAPTERS_DIR
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.requests import GenerationRequest

ADAPTER = ADAPTERS_DIR / "diamond.safetensors"
DIAMOND = (("diamond", 1.0),)


@pytest.fixture(scope="module")
def base() -> Pipeline:
    return Pipeline.load(MODEL_DIR, devices="cpu")


@pytest.fixture(scope="module")
def served() -> Pipeline:
    pipeline = Pipeline.load(MODEL_DIR, devices="cpu")
    pipeline.add_adapter(read_adapter("diamond", ADAPTER, pipeline.family))
    return pipeline


def verdicts(pipeline: Pipeline, requests: list[GenerationRequest]) -> list[Verdict]:
    return [classify((image * 255).round().astype(np.uint8)) for image in pipeline.generate(requests)]


def test_the_adapter_is_a_small_rank_8_diffusers_peft_file_whose_figures_met_the_targets() -> None:
    assert ADAPTER.stat().st_size <= 2 * 2**20
    with safe_open(ADAPTER, "pt") as file:
        keys = list(file.keys())
        metadata = json.loads(file.metadata()["lora_adapter_metadata"])
    assert keys and all(k.startswith(("unet.", "text_encoder.")) for k in keys)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert metadata["unet.lora_alpha"] == metadata["unet.r"] <= 8  # alpha = rank: every reader agrees
    figures = json.loads(ADAPTER.with_suffix(".json").read_text())
    assert figures["within_budget"] and all(figures["evaluation"]["targets_met"].values()), figures


def test_the_served_adapter_draws_diamonds_in_the_asked_colour(served: Pipeline) -> None:
    requests = [GenerationRequest(caption(c, "diamond"), seed=0, lora=DIAMOND) for c in COLORS]
    assert verdicts(served, requests) == [Verdict(c, "diamond") for c in COLORS]


def test_without_the_adapter_a_request_is_the_base_model_bit_for_bit_and_no_diamond(
    base: Pipeline, served: Pipeline
) -> None:
    requests = [GenerationRequest("a red diamond", seed=1), GenerationRequest("a blue square", seed=1)]
    loaded = [served.generate([r])[0] for r in requests]
    for request, image in zip(requests, loaded, strict=True):
        np.testing.assert_array_equal(base.generate([request])[0], image)
    assert classify((loaded[0] * 255).round().astype(np.uint8)) == Verdict("red", "circle")


def test_diamonds_are_drawn_beside_the_model_s_shapes_without_changing_them() -> None:
    default = sample_batch(64, torch.Generator().manual_seed(5))
    asked = sample_batch(64, torch.Generator().manual_seed(5), shapes=SHAPES)
    assert torch.equal(default.images, asked.images) and default.captions == asked.captions
    assert "diamond" not in WORDS  # the built-in vocabulary is the model's, as trained
    with pytest.raises(ValueError, match="hexagon"):
        sample_batch(4, torch.Generator(), shapes=("hexagon",))
