"""The GPU check: one command that spends a lent GPU's lease on proof, in phases, with one report.

    python -m benchmarks.gpu_check [--bundle .gpu] [--device cuda|cpu] [--quick] [--out DIR]

Phases, each a child process with its own time limit, in order of what matters most (a run
takes what fits in `--budget-s`; `--only` takes the rest in another):
1. `facts`: the GPU, driver, torch, CUDA, free memory, and the versions of every package the
   later phases import (imported here first, so a missing one is named before anything runs);
2. `tests`: the `gpu`-marked tests (`pytest -m gpu`), each test's outcome;
3. `serve`: one request through uvicorn on the device (a tiny SD-1.5 folder), /metrics scraped;
4. `compile:flux`, `compile:wan`: `--compile blocks` against eager through our walk, just in
   time (benchmarks/gpu/compiled.py), FLUX.1-dev's also in float8 against bfloat16 eager;
5. `serve:flux`: FLUX.1-dev at 1024², 28 steps, through uvicorn, random weights made on the device;
6. `bench:NAME`: real shapes, random weights made on the device (benchmarks/gpu/shapes.py,
   models.py): a lone step ours vs diffusers', rows/s by batch, memory three ways, and for
   SDXL, FLUX.1 and Wan 2.1 first-block caching and float8 vs bf16; then `compile:sdxl`.
A phase writes its results as JSON lines as it goes; this process merges them into
`gpu-check.json` under `--out` after every phase, so a phase that runs out of time (or a lease
that ends) keeps what finished. The last lines printed are a short table.

The compile phases share one cache folder; its cache artifacts (not inductor's kernel files:
the artifacts hold them, and the carry is small) come back under `--out`'s `compile-cache/`.
Put them in the bundle's `compile-cache/` (or pass `--compile-cache`) and the next run starts
from them: a cache made with another torch or device is refused by its key and compiled anew.

`--bundle DIR`: install DIR's wheels (`make gpu-bundle`) into a temporary site first, for a
machine without network. `--device cpu --quick` runs every phase on the CPU at tiny shapes: the
dry run the test suite makes, so the script never rots. Only the standard library is imported
here: the packages may not be installed until `--bundle` has run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.forking import Forked

ROOT = Path(__file__).resolve().parents[1]
REPORT = "gpu-check.json"
ARTIFACTS = "compiled/artifacts-*.bin"  # GraphStore's, under a cache folder
KEPT_CACHE = "compile-cache"  # under --out, and the bundle's to start from


@dataclass(frozen=True)
class Phase:
    name: str
    module: str  # run as `python -m module args...`
    args: tuple[str, ...]
    limit_s: float  # on an H200, cold caches; the quick dry run's are the same
    cached: bool = False  # given the shared compile cache folder (`--cache-dir`)


def phases() -> list[Phase]:
    bench, compiled = "benchmarks.gpu.models", "benchmarks.gpu.compiled"
    return [
        Phase("facts", "benchmarks.gpu.facts", (), 90),
        Phase("tests", "benchmarks.gpu.tests", (), 200),
        Phase("serve", "benchmarks.gpu.served", (), 90),
        # FLUX.1-dev's first calls, measured: 15 s compiled, 179 s compiled in float8
        Phase("compile:flux", compiled, ("flux", "--float8"), 300, cached=True),
        Phase("serve:flux", "benchmarks.gpu.served_flux", (), 150),
        Phase("compile:wan", compiled, ("wan",), 180, cached=True),  # its first call: 94 s
        Phase("bench:flux", bench, ("flux",), 90),
        Phase("bench:wan", bench, ("wan",), 120),
        Phase("bench:sdxl", bench, ("sdxl",), 75),
        Phase("compile:sdxl", compiled, ("sdxl",), 150, cached=True),
        Phase("bench:qwen", bench, ("qwen",), 120),
        Phase("bench:zimage", bench, ("zimage",), 90),
        Phase("bench:wan22-5b", bench, ("wan22-5b",), 150),
        Phase("bench:flux2", bench, ("flux2",), 150),
        Phase("bench:wan22-a14b", bench, ("wan22-a14b",), 180),
    ]


PHASE_NAMES = [phase.name for phase in phases()]


def install_bundle(bundle: Path) -> Path:
    """`bundle`'s wheels installed into a fresh temporary site (no index: the machine has no network),
    compiled to bytecode there: Python 3.12 warns of torchao's invalid escapes when it compiles
    them at import, which the tests' `filterwarnings = error` would make a collection error."""
    wheels = sorted(bundle.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {bundle}: run `make gpu-bundle` on a machine with network first")
    site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--target",
            str(site),
            *map(str, wheels),
        ],
        check=True,
    )
    return site


def seed_cache(cache: Path, kept: Path | None) -> list[str]:
    """`kept`'s cache artifacts (an earlier run's `compile-cache/`) copied into `cache`: their names."""
    if kept is None or not kept.is_dir():
        return []
    (cache / "compiled").mkdir(parents=True, exist_ok=True)
    seeded = sorted(kept.glob(Path(ARTIFACTS).name))
    for artifacts in seeded:
        shutil.copy2(artifacts, cache / "compiled" / artifacts.name)
    return [artifacts.name for artifacts in seeded]


def keep_cache(cache: Path, out: Path) -> dict[str, float]:
    """`cache`'s artifacts copied under `out` for the next run: their MiB by name."""
    kept = {}
    for artifacts in sorted(cache.glob(ARTIFACTS)):
        (out / KEPT_CACHE).mkdir(exist_ok=True)
        shutil.copy2(artifacts, out / KEPT_CACHE / artifacts.name)
        kept[artifacts.name] = round(artifacts.stat().st_size / 2**20, 1)
    return kept


def run_phase(
    phase: Phase,
    common: list[str],
    out: Path,
    limit_s: float,
    env: dict[str, str],
    cache: Path | None = None,
    forked: Forked | None = None,
) -> dict:
    """The phase as a child process (forked from `forked`, when given); its JSON lines, however
    far it got, and how it ended."""
    lines_file = out / f"{phase.name.replace(':', '-')}.jsonl"
    log_file = out / f"{phase.name.replace(':', '-')}.log"
    args = [*phase.args, *common, "--lines", str(lines_file)]
    if phase.cached and cache is not None:
        args += ["--cache-dir", str(cache)]
    started = time.monotonic()
    with log_file.open("w") as log:
        # a session of its own: at the limit, its children (pytest, a server) go with it
        if forked is not None:
            fd = log.fileno()
            child = forked.spawn(phase.module, *args, env=env, stdout=fd, stderr=fd, session=True)
        else:
            child = subprocess.Popen(
                [sys.executable, "-m", phase.module, *args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            code = child.wait(timeout=limit_s)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = f"timed out after {limit_s:.0f} s"
    results = []
    if lines_file.exists():
        for line in lines_file.read_text().splitlines():
            try:
                results.append(json.loads(line))
            except json.JSONDecodeError:
                results.append({"unreadable": line[:200]})  # cut off mid-line by a kill
        lines_file.unlink()
    section = {"status": status, "seconds": round(time.monotonic() - started, 1), "results": results}
    if status != "ok":
        section["log_tail"] = log_file.read_text()[-3000:]
    return section


def table(report: dict) -> list[str]:
    """One line a phase, with its headline figures: what the reply's last lines show."""
    rows = [f"{'phase':<16} {'status':<24} {'s':>6}  headline"]
    for name, section in report["phases"].items():
        headline = "; ".join(r["headline"] for r in section["results"] if "headline" in r)
        rows.append(f"{name:<16} {section['status'][:24]:<24} {section['seconds']:>6}  {headline[:400]}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few rounds: the dry run")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"))
    parser.add_argument("--bundle", type=Path, help="install these wheels into a temporary site first")
    parser.add_argument("--budget-s", type=float, default=480, help="all phases together (default: 480)")
    parser.add_argument("--only", help="comma-separated phase names (default: all)")
    parser.add_argument(
        "--fork",
        action="store_true",
        help="start each phase forked from one process that imported "
        "torch, diffusers and the server once (the dry run: seconds saved a phase)",
    )
    parser.add_argument(
        "--compile-cache",
        type=Path,
        help=f"an earlier run's {KEPT_CACHE}/ to start the compile phases "
        f"from (default: the bundle's {KEPT_CACHE}/, when there)",
    )
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    path = [str(ROOT)]
    if args.bundle:
        path.insert(0, str(install_bundle(args.bundle)))
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    common = ["--device", args.device, *(["--quick"] if args.quick else [])]
    chosen = set(args.only.split(",")) if args.only else None
    if unknown := (chosen or set()) - set(PHASE_NAMES):
        parser.error(f"--only: no phase {', '.join(sorted(unknown))}; phases: {', '.join(PHASE_NAMES)}")
    cache = Path(tempfile.mkdtemp(prefix="gpu-check-cache-"))
    kept = args.compile_cache or (args.bundle / KEPT_CACHE if args.bundle else None)

    report: dict = {"device": args.device, "quick": args.quick, "budget_s": args.budget_s, "phases": {}}
    report["compile_cache"] = {"seeded": seed_cache(cache, kept)}
    forked = None
    if args.fork:
        from tests.support.forking import Forked  # the standard library only, as this module

        forked = Forked(Path(tempfile.mkdtemp(prefix="gpu-check-fork-")), env)
    deadline = time.monotonic() + args.budget_s
    for phase in phases():
        if chosen is not None and phase.name not in chosen:
            continue
        left = deadline - time.monotonic()
        if left < 10:
            report["phases"][phase.name] = {"status": "skipped: budget spent", "seconds": 0, "results": []}
            continue
        report["phases"][phase.name] = run_phase(
            phase, common, args.out, min(phase.limit_s, left), env, cache, forked
        )
        report["compile_cache"]["kept"] = keep_cache(cache, args.out)
        (args.out / REPORT).write_text(json.dumps(report, indent=1))
    shutil.rmtree(cache, ignore_errors=True)
    if forked is not None:
        forked.close()
    lines = table(report)
    (args.out / REPORT).write_text(json.dumps({**report, "table": lines}, indent=1))
    print("\n".join(lines))
    return 0 if all(s["status"] == "ok" for s in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
