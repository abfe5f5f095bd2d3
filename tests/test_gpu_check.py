"""The GPU check (`python -m benchmarks.gpu_check`) dry-run on the CPU, once for the module; the
bundle that carries what the GPU image lacks; a phase killed at its limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from importlib.metadata import Distribution, distributions, version
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from benchmarks.gpu.bundle import IMAGE, PINS, ROOT, normalize, read_list
from benchmarks.gpu.tests import gpu_test_files
from benchmarks.gpu_check import KEPT_CACHE, PHASE_NAMES, Phase, run_phase

# the device: CPython 3.12 on Linux x86_64 (a requirement under an extra never applies)
DEVICE = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
DryRun = tuple[dict, list[str], Path]  # the report, the gpu-marked tests collected, --out


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    """The dry run's report, and the gpu-marked tests pytest collects (alongside, while it runs)."""
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    collect = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            *gpu_test_files(),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(out),
            "--budget-s",
            "900",
            "--fork",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    collected = collect.communicate(timeout=120)[0]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert collect.returncode == 0, collected[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    return report, [line for line in collected.splitlines() if "::" in line], out


def test_the_dry_run_passes_every_phase_with_the_results_each_promises(dry_run: DryRun) -> None:
    from benchmarks.gpu.shapes import TINY

    report, gpu_tests, out = dry_run
    sections = report["phases"]
    assert list(sections) == PHASE_NAMES
    for name, section in sections.items():
        assert section["status"] == "ok" and section["results"], (name, section)

    facts = {key: value for line in sections["facts"]["results"] for key, value in line.items()}
    assert facts["imports"] and set(facts["imports"].values()) == {"ok"}, facts["imports"]

    ran = [line for line in sections["tests"]["results"] if "outcome" in line]
    assert len(gpu_tests) >= 20
    assert sorted(line["test"] for line in ran) == sorted(gpu_tests)
    for line in ran:
        assert line["outcome"] == "skipped" and "CUDA" in line["reason"], line

    served = sections["serve"]["results"][0]
    assert served["status"] == 200 and len(served["images"]) == 2, served
    assert served["metrics_series"] and all(
        found and all("cpu" in series for series in found) for found in served["metrics_series"].values()
    ), served["metrics_series"]

    benched = [name.removeprefix("bench:") for name in PHASE_NAMES if name.startswith("bench:")]
    assert sorted(benched) == sorted(TINY)
    for model in benched:
        measured = [line for line in sections[f"bench:{model}"]["results"] if "measure" in line]
        assert {line["measure"] for line in measured} == TINY[model].measures, measured
        (lone,) = [line for line in measured if line["measure"] == "lone_step"]
        assert lone["relative_difference"] < 1e-2, lone  # our walk is diffusers' forward
        batched = sorted(line["rows"] for line in measured if line["measure"] == "batching")
        assert batched == sorted(TINY[model].rows), measured
        for quantized in (line for line in measured if line["measure"] == "quantized"):
            assert "refused" not in quantized, quantized

    for model in ("flux", "wan", "sdxl"):
        results = sections[f"compile:{model}"]["results"]
        (compiled,) = [line for line in results if line.get("measure") == "compile_blocks"]
        assert compiled["route"] == "jit" and compiled["calls"]["compiled"] > 0, compiled
        assert compiled["relative_difference"] < 1e-1, compiled
    (quantized,) = [line for line in sections["compile:flux"]["results"] if "mode" in line]
    assert quantized["mode"] == "int8-dynamic" and quantized["calls"]["compiled"] > 0, quantized
    assert quantized["relative_difference"] < 1e-1, quantized  # against bfloat16's output
    # the compile phases' cache artifacts come back for the next run, and it starts from them
    kept = report["compile_cache"]["kept"]
    assert kept and sorted(kept) == sorted(path.name for path in (out / KEPT_CACHE).iterdir()), kept
    assert report["compile_cache"]["seeded"] == []
    caches = [
        line["cache"]
        for name in ("flux", "wan")
        for line in sections[f"compile:{name}"]["results"]
        if "cache" in line
    ]
    assert caches == ["cold", "from cache artifacts"], caches

    rows = report["table"][1:]
    assert [row.split()[0] for row in rows] == PHASE_NAMES
    assert all(row.split()[1] == "ok" for row in rows), rows


def runtime_requirements(dist: Distribution) -> set[str]:
    """What `dist` needs installed on the device, as normalized names (extras left out)."""
    needed = set()
    for line in dist.requires or ():
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(DEVICE):
            needed.add(normalize(requirement.name))
    return needed


def optional_requirements(dist: Distribution) -> set[str]:
    """What `dist` offers under an extra: imported where present, skipped where not (requests
    tries PySocks), so the device need not have it."""
    return {
        normalize(Requirement(line).name)
        for line in dist.requires or ()
        if Requirement(line).marker is not None and "extra" in str(Requirement(line).marker)
    }


def installed() -> dict[str, Distribution]:
    return {normalize(dist.metadata["Name"]): dist for dist in distributions()}


def the_device_has() -> set[str]:
    return set(read_list(IMAGE)) | set(read_list(PINS))


def test_the_bundle_names_every_package_the_check_imports_that_the_image_lacks(
    dry_run: DryRun,
) -> None:
    report, _, _ = dry_run
    (imported,) = [line["imported"] for line in report["phases"]["facts"]["results"] if "imported" in line]
    required_by: dict[str, set[str]] = {}
    optional: set[str] = set()
    for name, dist in installed().items():
        if name != "diffshard":
            for needed in runtime_requirements(dist) - {name}:
                required_by.setdefault(needed, set()).add(name)
            optional |= optional_requirements(dist)
    # a package imported only because another needs it is that one's to bring (or the image's);
    # one another offers as an extra is tried and skipped where absent
    direct = {normalize(name) for name in imported} - set(required_by) - optional - {"diffshard"}
    assert direct - the_device_has() == set(), "imported, but neither in image.txt nor in bundle.txt"


def test_every_bundled_package_finds_its_own_requirements_in_the_image_or_the_bundle() -> None:
    dists, has = installed(), the_device_has()
    lacking = {
        name: sorted(runtime_requirements(dists[name]) - has)
        for name in read_list(PINS)
        if runtime_requirements(dists[name]) - has
    }
    assert lacking == {}, "bundle.txt's packages need these, which neither list names"


def test_the_bundle_pins_what_constraints_pin_and_this_venv_runs() -> None:
    pins, constrained = read_list(PINS), read_list(ROOT / "constraints.txt")
    assert all(pins.values()), pins
    disagree = {
        name: (pin, constrained[name]) for name, pin in pins.items() if constrained.get(name, pin) != pin
    }
    assert disagree == {}, "bundle.txt pin vs constraints.txt"
    stale = {name: (pin, version(name)) for name, pin in pins.items() if version(name) != pin}
    assert stale == {}, "bundle.txt pin vs this venv"


def survivors(marker: str) -> list[int]:
    """Our processes whose environment carries `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("started_as", ["process", "fork"])
def test_a_phase_past_its_limit_is_killed_with_its_children_and_still_reported(
    tmp_path: Path, started_as: str, fork_server
) -> None:
    # the tests phase writes its files, then runs pytest, which takes seconds to collect
    marker = f"GPU_CHECK_KILL_TEST={uuid.uuid4().hex}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", marker.split("=")[0]: marker.split("=")[1]}
    forked = fork_server() if started_as == "fork" else None
    started = time.monotonic()
    slow = Phase("slow", "benchmarks.gpu.tests", (), 2)
    section = run_phase(slow, ["--device", "cpu"], tmp_path, 2, env, forked=forked)
    assert time.monotonic() - started < 6
    assert section["status"].startswith("timed out"), section
    assert "log_tail" in section
    assert section["results"][0] == {"files": gpu_test_files()}  # what was written before the kill
    deadline = time.monotonic() + 1  # SIGKILLed: gone at once (an orphan pytest lives seconds)
    while (left := survivors(marker)) and time.monotonic() < deadline:
        pass
    assert left == [], "a child of the phase outlived its kill"
