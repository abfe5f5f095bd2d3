"""Tiny real diffusers UNets built from config under fixed seeds; a live server with API keys;
`gpu` tests skip without CUDA."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from tests.live import MAKE_RUN, LiveServer, free_port, live_server
from tests.tiny_pipelines import BUILDERS, build_sd3_folder


def tiny_sd15_unet() -> UNet2DConditionModel:
    """SD-1.5-shaped: cross-attention down/up blocks around a plain pair, 3 levels."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        block_out_channels=(32, 32, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=2,
        cross_attention_dim=32,
        attention_head_dim=8,
    ).eval()


def tiny_sdxl_unet() -> UNet2DConditionModel:
    """SDXL-shaped: text_time added embeddings, linear projections, 2 transformer layers deep."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        layers_per_block=2,
        transformer_layers_per_block=(1, 2),
        cross_attention_dim=32,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,
    ).eval()


TINY_UNETS = {"sd15": tiny_sd15_unet, "sdxl": tiny_sdxl_unet}


@pytest.fixture(params=sorted(TINY_UNETS))
def tiny_unet(request: pytest.FixtureRequest) -> UNet2DConditionModel:
    return TINY_UNETS[request.param]()


@pytest.fixture(scope="session", autouse=True)
def cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The planner's calibrations go to a folder of this session (servers started by tests
    inherit it), not to the user's ~/.cache: calibrated once a session, then reused."""
    folder = tmp_path_factory.mktemp("diffshard-cache")
    before = os.environ.get("DIFFSHARD_CACHE_DIR")
    os.environ["DIFFSHARD_CACHE_DIR"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("DIFFSHARD_CACHE_DIR", None)
    else:
        os.environ["DIFFSHARD_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SD-1.5- and SDXL-shaped pipeline folders (tests/tiny_pipelines.py), built once."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build(root / kind) for kind, build in BUILDERS.items()}


@pytest.fixture(scope="session")
def sd3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3-shaped pipeline folder (an MMDiT, two CLIP encoders, no T5), built once."""
    return build_sd3_folder(tmp_path_factory.mktemp("tiny") / "sd3")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not a keyword: a test id may say gpu
            item.add_marker(skip)


@pytest.fixture(scope="session")
def served() -> Iterator[LiveServer]:
    """The server as `make run` serves it (the built-in model, the diamond adapter) with a metrics
    port, shared by every module that needs nothing else: each start costs seconds of the suite.
    Tests on it read counters as differences, never as totals from zero."""
    with live_server(*MAKE_RUN, "--metrics-port", str(free_port())) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`python -m server serve --api-key-file` with the keys sk-first and sk-second."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# one key a line\nsk-first\nsk-second\n")
    with live_server("--api-key-file", str(keys)) as running:
        yield running
