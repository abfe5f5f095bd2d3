"""Frozen graphs kept whole (`server/engine/runtime/packages.py`): a library built from a small
convolution network (as a UNet's, float32, seeded) answers as the eager network does, lets go of
the GIL while it runs, is keyed by what its weights are, and one whose bytes are not those built
is never opened."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from server.engine.runtime import packages


def _network() -> nn.Module:
    torch.manual_seed(0)
    layers = (nn.Conv2d(128, 128, 3, padding=1), nn.SiLU(), nn.Conv2d(128, 128, 3, padding=1))
    return nn.Sequential(*layers).eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, torch.Tensor]:
    network, sample = _network(), torch.randn(4, 128, 128, 128)  # ~0.2 s a call
    path = tmp_path_factory.mktemp("compiled") / f"graph{packages.SUFFIX}"

    def run(x: torch.Tensor) -> torch.Tensor:
        return network(x)

    with torch.inference_mode():  # as the warm-up builds it
        assert packages.build(path, run, network, (sample,), ["flash"]) is not None
    return path, network, sample


def test_a_library_answers_as_its_network_and_keeps_its_attention_kernels(built) -> None:
    path, network, sample = built
    library, kernels = packages.load(path)
    with torch.inference_mode():
        assert torch.allclose(library(sample), network(sample), atol=1e-4)
    assert kernels == ["flash"]


def test_a_call_lets_go_of_the_gil(built) -> None:
    """This thread keeps running Python while another's call is in the library. torch's own
    runner holds the GIL nearly throughout: a thread beside it ran at 0.3% of its pace alone,
    replicas' calls ran one after another, and the event loop stalled."""
    path, _, sample = built
    library, _ = packages.load(path)
    spans: list[tuple[float, float]] = []
    done = threading.Event()

    def call() -> None:
        with torch.inference_mode():
            for _ in range(2):
                began = time.perf_counter()
                library(sample)
                spans.append((began, time.perf_counter()))
        done.set()

    beats = [time.perf_counter()]
    worker = threading.Thread(target=call)
    worker.start()
    while not done.is_set():  # beating: each beat needs the GIL
        beats.append(time.perf_counter())
    worker.join(timeout=60)
    began, ended = spans[-1]
    longest = max(b - a for a, b in itertools.pairwise(beats) if b > began and a < ended)
    assert longest < 0.5 * (ended - began), f"no beat for {longest:.3f} s of a {ended - began:.3f} s call"


def test_the_key_is_what_the_weights_are_and_a_damaged_library_is_never_opened(
    built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, network, _ = built
    same, changed = _network(), _network()
    with torch.no_grad():
        changed[0].weight[0, 0, 0, 0] += 1e-3
    assert packages.fingerprint(same) == packages.fingerprint(network) != packages.fingerprint(changed)
    damaged = tmp_path / path.name
    damaged.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # opened, it would crash us
    (tmp_path / path.with_suffix(".json").name).write_text(path.with_suffix(".json").read_text())
    with caplog.at_level(logging.WARNING, logger="diffshard"):
        assert packages.load(damaged) is None
    assert "is unusable (ValueError: its bytes are not those built)" in caplog.text
    assert packages.load(tmp_path / "absent.so") is None


def test_a_cache_directory_keeps_its_most_recently_used_libraries_within_its_bound(
    tmp_path: Path,
) -> None:
    """Past `--compiled-bytes`, the least recently used libraries go (with their JSON), never one this
    process has open; a build's folder left by a dead start goes after an hour."""
    libraries = {}
    for age, name in enumerate(("newest", "open", "older", "oldest")):
        libraries[name] = tmp_path / f"{name}{packages.SUFFIX}"
        libraries[name].write_bytes(bytes(1000))
        libraries[name].with_suffix(".json").write_text("{}")
        os.utime(libraries[name], (time.time() - 60 * age,) * 2)
    left, fresh = tmp_path / ".building-left", tmp_path / ".building-now"
    left.mkdir(), fresh.mkdir()
    os.utime(left, (time.time() - 2 * packages.STALE_BUILD_S,) * 2)
    packages.prune(tmp_path, {libraries["open"], libraries["oldest"]}, kept_bytes=2500)
    assert [name for name, path in libraries.items() if path.exists()] == ["newest", "open", "oldest"]
    assert not libraries["older"].with_suffix(".json").exists()
    assert fresh.exists() and not left.exists()
