"""The GPU check: one command that spends a lent GPU's lease on proof, in phases, with one report.

    python -m benchmarks.gpu_check [--bundle .gpu] [--device cuda|cpu] [--quick] [--out DIR]

Phases, each a child process with its own time limit, in order of what matters most:
1. `facts`: the GPU, driver, torch, CUDA, free memory, and the versions of every package the
   later phases import (imported here first, so a missing one is named before anything runs);
2. `tests`: the `gpu`-marked tests (`pytest -m gpu`), each test's outcome;
3. `serve`: one request through uvicorn on the device (a tiny SD-1.5 folder), /metrics scraped;
4. `bench:sdxl`, `bench:flux`, `bench:wan`: real shapes, random weights made on the device
   (benchmarks/gpu/models.py): a lone step ours vs diffusers', rows/s by batch, first-block
   caching, memory three ways, float8 vs bf16;
5. `compile`: `--compile blocks` against eager at the same shapes.
A phase writes its results as JSON lines as it goes; this process merges them into
`gpu-check.json` under `--out` after every phase, so a phase that runs out of time (or a lease
that ends) keeps what finished. The last lines printed are a short table.

`--bundle DIR`: install DIR's wheels (`make gpu-bundle`) into a temporary site first, for a
machine without network. `--device cpu --quick` runs every phase on the CPU at tiny shapes: the
dry run the test suite makes, so the script never rots. Only the standard library is imported
here: the packages may not be installed until `--bundle` has run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = "gpu-check.json"


@dataclass(frozen=True)
class Phase:
    name: str
    module: str  # run as `python -m module args...`
    args: tuple[str, ...]
    limit_s: float  # on a GPU; the quick dry run's are the same


def phases(quick: bool) -> list[Phase]:
    bench = "benchmarks.gpu.models"
    compiled = ("flux",) if quick else ("flux", "sdxl")  # compiling on a CPU takes a minute a model
    return [
        Phase("facts", "benchmarks.gpu.facts", (), 90),
        Phase("tests", "benchmarks.gpu.tests", (), 200),
        Phase("serve", "benchmarks.gpu.served", (), 90),
        Phase("bench:sdxl", bench, ("sdxl",), 75),
        Phase("bench:flux", bench, ("flux",), 90),
        Phase("bench:wan", bench, ("wan",), 120),
        Phase("compile", bench, (*compiled, "--compile"), 150),
    ]


PHASE_NAMES = [phase.name for phase in phases(quick=False)]


def install_bundle(bundle: Path) -> Path:
    """`bundle`'s wheels installed into a fresh temporary site (no index: the machine has no network),
    compiled to bytecode there: Python 3.12 warns of torchao's invalid escapes when it compiles
    them at import, which the tests' `filterwarnings = error` would make a collection error."""
    wheels = sorted(bundle.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {bundle}: run `make gpu-bundle` on a machine with network first")
    site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
         "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), *map(str, wheels)],
        check=True,
    )  # fmt: skip
    return site


def run_phase(phase: Phase, common: list[str], out: Path, limit_s: float, env: dict[str, str]) -> dict:
    """The phase as a child process; its JSON lines, however far it got, and how it ended."""
    lines_file = out / f"{phase.name.replace(':', '-')}.jsonl"
    log_file = out / f"{phase.name.replace(':', '-')}.log"
    command = [sys.executable, "-m", phase.module, *phase.args, *common, "--lines", str(lines_file)]
    started = time.monotonic()
    with log_file.open("w") as log:
        # a session of its own: at the limit, its children (pytest, a server) go with it
        child = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
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
    rows = [f"{'phase':<11} {'status':<24} {'s':>6}  headline"]
    for name, section in report["phases"].items():
        headline = "; ".join(r["headline"] for r in section["results"] if "headline" in r)
        rows.append(f"{name:<11} {section['status'][:24]:<24} {section['seconds']:>6}  {headline[:400]}")
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
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    path = [str(ROOT)]
    if args.bundle:
        path.insert(0, str(install_bundle(args.bundle)))
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    common = ["--device", args.device, *(["--quick"] if args.quick else [])]
    chosen = set(args.only.split(",")) if args.only else None
    if unknown := (chosen or set()) - {phase.name for phase in phases(args.quick)}:
        parser.error(f"--only: no phase {', '.join(sorted(unknown))}; phases: {', '.join(PHASE_NAMES)}")

    report: dict = {"device": args.device, "quick": args.quick, "budget_s": args.budget_s, "phases": {}}
    deadline = time.monotonic() + args.budget_s
    for phase in phases(args.quick):
        if chosen is not None and phase.name not in chosen:
            continue
        left = deadline - time.monotonic()
        if left < 10:
            report["phases"][phase.name] = {"status": "skipped: budget spent", "seconds": 0, "results": []}
            continue
        report["phases"][phase.name] = run_phase(phase, common, args.out, min(phase.limit_s, left), env)
        (args.out / REPORT).write_text(json.dumps(report, indent=1))
    lines = table(report)
    (args.out / REPORT).write_text(json.dumps({**report, "table": lines}, indent=1))
    print("\n".join(lines))
    return 0 if all(s["status"] == "ok" for s in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
