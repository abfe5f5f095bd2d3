"""Frozen graphs kept whole (`server/engine/runtime/packages.py`): a library built from a small
convolution network (as a UNet's, float32, seeded) in a process of its own answers as the eager
network does, lets go of the GIL while it runs, is keyed by what its weights are, and one whose
bytes are not those built is never opened. A build that dies, or is told to stop, leaves this
process as it was; one begun beside a call in flight, or while the step loops have work, ends."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from server.engine.runtime import packages
from server.engine.runtime.tracing import CompileStopped, GiveWay, trace_gate


def _network() -> nn.Module:
    torch.manual_seed(0)
    layers = (nn.Conv2d(128, 128, 3, padding=1), nn.SiLU(), nn.Conv2d(128, 128, 3, padding=1))
    return nn.Sequential(*layers).eval()


def _traced_by(network: nn.Module, processes: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`network`'s call, noting the process that runs it (export traces it by running it)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        processes.append(os.getpid())
        return network(x)

    return run


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, torch.Tensor, list[int]]:
    network, sample, traced_here = _network(), torch.randn(4, 128, 128, 128), []  # ~0.2 s a call
    path = tmp_path_factory.mktemp("compiled") / f"graph{packages.SUFFIX}"
    with torch.inference_mode():  # as the warm-up builds it
        assert packages.build(path, _traced_by(network, traced_here), network, (sample,), ["flash"])
    return path, network, sample, traced_here


def test_a_library_built_in_a_process_of_its_own_answers_as_its_network(built) -> None:
    """Traced and compiled in a forked child: nothing of it ran here, the library answers as the
    network does, and the attention kernels it was built with come back with it."""
    path, network, sample, traced_here = built
    assert traced_here == []
    library, kernels = packages.load(path)
    with torch.inference_mode():
        assert torch.allclose(library(sample), network(sample), atol=1e-4)
    assert kernels == ["flash"]


def test_a_build_begun_beside_a_call_in_flight_and_busy_step_loops_ends(tmp_path: Path) -> None:
    """The build forks once the call in flight has ended (a child forked mid-call waited forever
    for its copy of the gate to clear), and the child builds while the step loops have work, the
    compile that waits for it paused meanwhile."""
    network, sample, path = _network(), torch.randn(1, 128, 16, 16), tmp_path / f"graph{packages.SUFFIX}"
    gate, give_way, result = trace_gate(), GiveWay(), []
    calling, call_ends = threading.Event(), threading.Event()

    def call() -> None:
        with gate.call():
            calling.set()
            call_ends.wait(60)

    def build() -> None:
        with torch.inference_mode(), give_way.paused_while_serving():
            result.append(packages.build(path, network, network, (sample,), [], give_way.wait))

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert calling.wait(60)
    give_way.serving(True)
    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    _until(lambda: gate.traces_waiting == 1, "the build waits for the call")
    call_ends.set()
    _until(path.exists, "the library is built while the step loops have work")
    assert builder.is_alive()  # this thread waits for them: it loads the library once they have none
    give_way.serving(False)
    builder.join(timeout=60)
    caller.join(timeout=60)
    assert result and result[0] is not None


def test_a_build_that_dies_leaves_this_process_serving(tmp_path: Path) -> None:
    """Ended by a signal (here as the OOM killer would), the build raises: its graph is then never
    frozen just in time, in this process, which the same could end."""
    network, sample, here = _network(), torch.randn(1, 128, 16, 16), os.getpid()

    def dies(x: torch.Tensor) -> torch.Tensor:
        if os.getpid() != here:  # the build's process
            assert Path("/proc/self/oom_score_adj").read_text().strip() == "1000"  # the first to go
            os.kill(os.getpid(), signal.SIGKILL)
        return network(x)

    with pytest.raises(RuntimeError, match="its build was ended by signal 9"), torch.inference_mode():
        packages.build(tmp_path / f"graph{packages.SUFFIX}", dies, network, (sample,), [])
    assert not list(tmp_path.glob(f"*{packages.SUFFIX}")) and not list(tmp_path.glob(".building-*"))


def test_a_build_told_to_stop_is_ended_and_its_process_reaped(tmp_path: Path) -> None:
    network, sample, processes = _network(), torch.randn(1, 128, 16, 16), tmp_path / "processes"

    def noted(x: torch.Tensor) -> torch.Tensor:
        with processes.open("a") as file:
            file.write(f"{os.getpid()}\n")
        return network(x)

    def stop_once_begun() -> None:
        if processes.exists():
            raise CompileStopped

    with pytest.raises(CompileStopped), torch.inference_mode():
        packages.build(tmp_path / f"graph{packages.SUFFIX}", noted, network, (sample,), [], stop_once_begun)
    (child,) = set(processes.read_text().split())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no zombie left
        os.kill(int(child), 0)
    assert not list(tmp_path.glob(".building-*"))  # nor its folder


def _until(condition: Callable[[], bool], what: str, deadline_s: float = 120) -> None:
    deadline, pause = time.monotonic() + deadline_s, 0.01
    while not condition():
        assert time.monotonic() < deadline, f"not within {deadline_s} s: {what}"
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def test_a_call_lets_go_of_the_gil(built) -> None:
    """This thread keeps running Python while another's call is in the library. torch's own
    runner holds the GIL nearly throughout: a thread beside it ran at 0.3% of its pace alone,
    replicas' calls ran one after another, and the event loop stalled."""
    path, _, sample, _ = built
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
    path, network, _, _ = built
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
