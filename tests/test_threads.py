"""cpu_quota: affinity and cgroup v1/v2 quotas read from files a test writes; fit_threads."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from server.engine.hardware.threads import cpu_quota, fit_threads, set_intra_op_threads

AFFINITY = len(os.sched_getaffinity(0))
HUGE = "100000000 100000"  # a quota of 1000 CPUs: more than any affinity here


def quota(tmp_path: Path, v2: str | None = None, v1: tuple[str, str] | None = None) -> int:
    """cpu_quota with the kernel's files replaced by these contents (None: the file is missing)."""
    folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"  # a fresh folder per call
    folder.mkdir()
    paths = {name: folder / name for name in ("cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us")}
    for name, text in zip(paths, (v2, *(v1 or (None, None))), strict=True):
        if text is not None:
            paths[name].write_text(text + "\n")
    return cpu_quota(paths["cpu.max"], paths["cpu.cfs_quota_us"], paths["cpu.cfs_period_us"])


def test_cgroup_v2_without_a_limit_is_the_affinity(tmp_path: Path) -> None:
    assert quota(tmp_path, v2="max 100000") == AFFINITY


def test_cgroup_v2_quota_rounds_up_to_whole_cpus(tmp_path: Path) -> None:
    assert quota(tmp_path, v2="100000 100000") == 1
    assert quota(tmp_path, v2="50000 100000") == 1  # half a CPU still runs one thread


def test_cgroup_v2_fractional_quota(tmp_path: Path) -> None:
    pinned = os.sched_getaffinity(0)  # a test worker's share of the host (conftest.py)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the host's CPUs, for this test
    try:
        if len(os.sched_getaffinity(0)) < 2:
            pytest.skip("needs 2 CPUs of affinity to see 1.5 CPUs round up to 2")
        assert quota(tmp_path, v2="150000 100000") == 2
    finally:
        os.sched_setaffinity(0, pinned)


def test_cgroup_v1_quota_and_no_limit(tmp_path: Path) -> None:
    assert quota(tmp_path, v1=("100000", "100000")) == 1
    assert quota(tmp_path, v1=("-1", "100000")) == AFFINITY


def test_the_smaller_of_v1_and_v2_quotas_wins(tmp_path: Path) -> None:
    assert quota(tmp_path, v2="max 100000", v1=("100000", "100000")) == 1
    assert quota(tmp_path, v2="100000 100000", v1=("-1", "100000")) == 1


def test_an_affinity_smaller_than_the_quota_wins(tmp_path: Path) -> None:
    assert quota(tmp_path, v2=HUGE) == AFFINITY
    assert quota(tmp_path, v1=tuple(HUGE.split())) == AFFINITY


def test_missing_or_garbled_files_mean_no_quota(tmp_path: Path) -> None:
    assert quota(tmp_path) == AFFINITY
    assert quota(tmp_path, v2="lots 100000", v1=("", "100000")) == AFFINITY


def test_fit_threads_sets_torch_threads() -> None:
    before = torch.get_num_threads()
    try:
        assert fit_threads(1) == 1 and torch.get_num_threads() == 1
        assert fit_threads(None) == cpu_quota() == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("setter", [torch.set_num_threads, set_intra_op_threads], ids=["torch", "ours"])
def test_a_threads_count_survives_another_thread_setting_one_before_its_first_op(setter) -> None:
    """torch gives a thread its count at its first parallel op from the last count set on any
    thread: a lane that set 1 and ran its first op after the main thread set 2 ran at 2 from then
    on (torch's own setter, kept here to show the race is real). `set_intra_op_threads` holds."""
    set_in_lane, main_set = threading.Event(), threading.Event()
    seen: list[int] = []

    def lane() -> None:
        setter(1)
        set_in_lane.set()
        assert main_set.wait(timeout=30)
        x = torch.randn(256, 256)
        x @ x  # the thread's first parallel op
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    try:
        thread = threading.Thread(target=lane)
        thread.start()
        assert set_in_lane.wait(timeout=30)
        torch.set_num_threads(2)
        main_set.set()
        thread.join(timeout=30)
    finally:
        torch.set_num_threads(before)
    assert seen == ([2] if setter is torch.set_num_threads else [1])


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_a_process_pinned_to_one_cpu_sees_one() -> None:
    code = "from server.engine.hardware.threads import cpu_quota; print(cpu_quota())"
    done = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_a_lone_call_takes_the_idle_replicas_threads_and_gives_them_back() -> None:
    """`Lane.idle_cores`: a lane of 1 thread with one idle replica runs a decode on 2, then 1 again;
    with none idle (or a lane leaving torch's threads alone) nothing changes."""
    from server.pipeline.loading.deployment import Lane

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        idle: list = ["a replica"]
        lane = Lane(shard=None, spare=lambda: idle)  # type: ignore[arg-type]
        with lane.idle_cores(1) as wider:
            assert torch.get_num_threads() == 2 and wider
        assert torch.get_num_threads() == 1
        idle.clear()
        with lane.idle_cores(1) as wider:
            assert torch.get_num_threads() == 1 and not wider
        with Lane(shard=None, spare=lambda: ["a replica"]).idle_cores(None) as wider:  # type: ignore[arg-type]
            assert torch.get_num_threads() == 1 and not wider
    finally:
        torch.set_num_threads(before)
