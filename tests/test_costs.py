"""The cost model's numbers and their cache: counted work scales with rows as a recount does, a
calibration is timed once per host and reused, an unwritable cache only warns, measured costs
are reused by the next plan, `plan` with several CPU devices answers in seconds, and GPUs this
host lacks are predicted from a device profile."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from server.engine import CostModel, Costs, Parallel
from server.engine.hardware.devices import auto_dtype
from server.engine.hardware.gpus import MATMUL_SHARE, gpu_profile
from server.engine.hardware.threads import cpu_quota
from server.engine.planning.calibrate import DeviceSpeed, cached_calibration
from server.engine.planning.costs import profile_note, profile_speed
from server.engine.planning.parallel import weighed_shapes
from server.engine.planning.work import count_work
from server.errors import ConfigError, PlanError
from tests.conftest import Cli, tiny_sd15_unet


def test_work_counted_at_one_row_equals_two_rows_scaled() -> None:
    """A lone image's split is costed by scaling one count: FLOPs and activations halve, the
    weights each op reads do not."""
    model = tiny_sd15_unet()
    two, one = count_work(model, 2, 16, torch.float32), count_work(model, 1, 16, torch.float32)
    scaled = two.at_rows(1)
    for name, block in one.blocks.items():
        assert scaled.blocks[name].flops() == pytest.approx(block.flops())
        assert scaled.blocks[name].bytes == pytest.approx(
            block.bytes, rel=2e-2
        )  # fixed-size tensors (time ids) aside
    assert two.flops == pytest.approx(2 * one.flops)


def test_a_calibration_is_timed_once_and_then_read_back(tmp_path: Path) -> None:
    first = cached_calibration("cpu", torch.float32, 1, tmp_path)
    stored = tmp_path / "calibration.json"
    written = stored.stat().st_mtime_ns
    started = time.perf_counter()
    again = cached_calibration("cpu", torch.float32, 1, tmp_path)
    assert again == first and isinstance(again, DeviceSpeed)
    assert time.perf_counter() - started < 0.1 and stored.stat().st_mtime_ns == written  # read, not timed
    assert first.rate("conv", 32) <= first.rate("conv", 2048)  # interpolated between the sizes timed


def test_an_unwritable_cache_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="diffshard"):
        speed = cached_calibration("cpu", torch.float32, 1, blocked)
    assert speed.bytes_per_s > 0
    assert "cannot write the planner's cache" in caplog.text


def test_measured_costs_are_reused_by_the_next_plan(tmp_path: Path) -> None:
    model = tiny_sd15_unet()
    first = CostModel(model, 2, 8, torch.float32, Costs.MEASURED, tmp_path).costs("cpu", 1)
    (entry,) = json.loads((tmp_path / "measured.json").read_text())["entries"]
    assert entry["key"]["rows"] == 2 and entry["key"]["latent_size"] == 8 and entry["key"]["threads"] == 1
    assert CostModel(model, 2, 8, torch.float32, Costs.MEASURED, tmp_path).costs("cpu", 1) == first


def test_plan_on_three_cpu_devices_lists_every_candidate_in_seconds(run_cli: Cli) -> None:
    started = time.perf_counter()
    done = run_cli("plan", "--config", "sd15", "--devices", "cpu,cpu,cpu", "--json")
    assert done.returncode == 0, done.stderr
    assert time.perf_counter() - started < 60  # minutes before costs were counted (a bound, not a benchmark)
    parallel = json.loads(done.stdout)["parallel"]
    assert parallel["costs"].startswith("counted")
    shapes = {(c["replicas"], c["stages"]) for c in parallel["candidates"]}
    assert shapes == {
        *weighed_shapes(3, Parallel.AUTO, cpu_quota()),
        (1, 1),
    }  # subsets too: (2, 1) on 2 cores
    assert all(
        c["predicted_rows_per_s"] > 0 and c["predicted_lone_step_s"] > 0 for c in parallel["candidates"]
    )
    busy, quota = parallel["lanes"] * parallel["threads_per_worker"], cpu_quota()
    assert (
        quota - parallel["lanes"] < busy <= quota
    )  # every core (an uneven split's remainder aside), no more


def test_an_absent_gpu_is_predicted_from_its_device_profile(tmp_path: Path) -> None:
    """A GPU this host lacks is neither calibrated nor timed: its counted work runs through the
    roofline with the profile's published peaks (bfloat16 at the FP32 rate where it is not
    native), and a faster GPU is predicted faster."""
    model = tiny_sd15_unet()
    h100 = CostModel(model, 2, 8, torch.bfloat16, cache_dir=tmp_path, profile="h100").costs("cuda:15")
    t4 = CostModel(model, 2, 8, torch.bfloat16, cache_dir=tmp_path, profile="t4").costs("cuda:15")
    assert all(0 < h100[block] < t4[block] for block in h100)
    assert not (tmp_path / "calibration.json").exists()  # nothing timed
    speed = profile_speed(gpu_profile("H100"), torch.bfloat16)
    assert speed.rate("matmul", 2048) == pytest.approx(989.4e12 * MATMUL_SHARE)
    assert profile_speed(gpu_profile("t4"), torch.bfloat16).rate("matmul", 2048) == pytest.approx(
        8.1e12 * MATMUL_SHARE
    )
    with pytest.raises(PlanError, match="cuda:15 is not on this host"):
        CostModel(model, 2, 8, torch.bfloat16, Costs.MEASURED, tmp_path).costs("cuda:15")


def test_an_absent_gpu_takes_its_profiles_auto_dtype_and_unknown_profiles_are_named() -> None:
    assert auto_dtype(["cuda:14", "cuda:15"]) == torch.bfloat16  # the default profile: an H100
    assert auto_dtype(["cuda:15"], "t4") == torch.float16  # no bfloat16 on Turing, as on a real T4
    assert "predicted from the l4 profile, NVIDIA L4's published peaks" in profile_note(
        ["cuda:15"], "l4", torch.bfloat16
    )
    assert profile_note(["cpu"], None, torch.float32) == ""
    with pytest.raises(ConfigError, match="unknown device profile 'h1000': choose one of h100, h100-pcie"):
        gpu_profile("h1000")
