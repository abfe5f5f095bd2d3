"""The rule-based judge of shapes images: right on dataset images, clean and degraded, and on
the diamonds (dataset.NEW_SHAPES) an adapter teaches the built-in model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from server.demo.dataset import SHAPES, Batch, sample_batch, to_uint8
from server.demo.evaluate import Verdict, accuracy, classify, main


@pytest.fixture(scope="module")
def batch() -> Batch:
    return sample_batch(1000, torch.Generator().manual_seed(1234))


def blur(images: torch.Tensor, k: int) -> torch.Tensor:
    """A k×k box blur per channel; edge padding keeps the background level at the border."""
    kernel = torch.full((3, 1, k, k), 1 / k**2)
    return F.conv2d(F.pad(images, (k // 2,) * 4, mode="replicate"), kernel, groups=3)


def toward_gray(images: torch.Tensor, amount: float) -> torch.Tensor:
    return images + amount * (images.mean(dim=1, keepdim=True) - images)


def test_dataset_images_are_classified(batch: Batch) -> None:
    acc = accuracy(batch.images, batch.colors, batch.shapes)
    assert acc["n"] == 1000
    assert acc["color"] >= 0.98 and acc["shape"] >= 0.98, acc


@pytest.mark.parametrize("k", [3, 5])
def test_blurred_and_desaturated_images_are_classified(batch: Batch, k: int) -> None:
    degraded = toward_gray(blur(batch.images, k), 0.25)
    acc = accuracy(degraded, batch.colors, batch.shapes)
    assert acc["color"] >= 0.95 and acc["shape"] >= 0.95, acc


@pytest.fixture(scope="module")
def diamonds() -> Batch:
    return sample_batch(500, torch.Generator().manual_seed(4321), shapes=("diamond",))


@pytest.mark.parametrize("k", [0, 3, 5])
def test_drawn_diamonds_are_diamonds_clean_blurred_and_desaturated(diamonds: Batch, k: int) -> None:
    images = toward_gray(blur(diamonds.images, k), 0.25) if k else diamonds.images
    acc = accuracy(images, diamonds.colors, diamonds.shapes)
    assert acc["color"] >= 0.98 and acc["shape"] >= (0.98 if k < 5 else 0.95), acc


@pytest.mark.parametrize("k", [0, 3, 5])
def test_drawn_squares_circles_and_triangles_are_never_diamonds(batch: Batch, k: int) -> None:
    images = toward_gray(blur(batch.images, k), 0.25) if k else batch.images
    shapes = [classify(image).shape for image in images]
    assert "diamond" not in shapes
    squares = [s for s, drawn in zip(shapes, batch.shapes, strict=True) if drawn == "square"]
    assert len(squares) > 250 and set(squares) == {"square"}


def test_a_mixed_batch_of_all_four_shapes_is_classified() -> None:
    mixed = sample_batch(400, torch.Generator().manual_seed(99), shapes=(*SHAPES, "diamond"))
    assert set(mixed.shapes) == {*SHAPES, "diamond"}
    acc = accuracy(mixed.images, mixed.colors, mixed.shapes)
    assert acc["color"] >= 0.98 and acc["shape"] >= 0.98, acc


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_background_alone_has_no_object(noise: float) -> None:
    g = torch.Generator().manual_seed(0)
    image = (torch.full((3, 64, 64), -0.85) + noise * torch.randn(3, 64, 64, generator=g)).clamp(-1, 1)
    assert classify(image) == Verdict(None, None)


def test_input_kinds_agree(batch: Batch) -> None:
    images = batch.images[:12]
    for image, array, color, shape in zip(
        images, to_uint8(images).numpy(), batch.colors[:12], batch.shapes[:12], strict=True
    ):
        expected = Verdict(color, shape)
        assert classify(image) == expected
        assert classify(array) == expected
        assert classify(torch.from_numpy(array)) == expected
        assert classify(Image.fromarray(array)) == expected


def test_accuracy_counts_mismatches(batch: Batch) -> None:
    colors = ["white" if c != "white" else "red" for c in batch.colors[:4]]
    acc = accuracy(batch.images[:4], colors, batch.shapes[:4])
    assert acc == {"color": 0.0, "shape": 1.0, "both": 0.0, "n": 4}
    with pytest.raises(ValueError):
        accuracy(batch.images[:4], batch.colors[:3], batch.shapes[:4])


def test_cli_prints_a_verdict_per_file(
    batch: Batch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for i, array in enumerate(to_uint8(batch.images[:2]).numpy()):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(array).save(paths[-1])
    assert main([str(p) for p in paths]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"{p}: {c} {s}" for p, c, s in zip(paths, batch.colors[:2], batch.shapes[:2], strict=True)
    ]
