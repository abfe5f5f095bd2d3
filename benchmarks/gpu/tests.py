"""The GPU check's tests phase: every `gpu`-marked test, each one's outcome a line as it ends.

Only the test files that hold a `gpu` mark are collected: the rest import packages the device
image lacks (the SDK, PyAV, Selenium) for tests that are not the GPU's to prove."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from benchmarks.gpu import Lines, phase_parser

ROOT = Path(__file__).resolve().parents[2]
PER_TEST_TIMEOUT_S = 90


def gpu_test_files() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


def main() -> None:
    args = phase_parser(__doc__).parse_args()
    lines = Lines(args.lines)
    files = gpu_test_files()
    lines.write({"files": files})
    timeout = ["--timeout", str(PER_TEST_TIMEOUT_S)] if importlib.util.find_spec("pytest_timeout") else []
    command = [
        sys.executable,
        "-m",
        "pytest",
        *files,
        "-m",
        "gpu",
        "-p",
        "benchmarks.gpu.outcomes",
        "-p",
        "no:cacheprovider",
        "-q",
        *timeout,
    ]
    code = subprocess.run(
        command, cwd=ROOT, env={**os.environ, "GPU_CHECK_LINES": str(args.lines)}
    ).returncode
    results = [json.loads(line) for line in args.lines.read_text().splitlines()]
    outcomes = Counter(result["outcome"] for result in results if "outcome" in result)
    counted = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
    failed = [r["test"].split("::")[-1] for r in results if r.get("outcome") in ("failed", "error")]
    headline = f"gpu tests: {counted or 'none ran'}" + (f" ({', '.join(failed)})" if failed else "")
    lines.write({"pytest_exit": code, "headline": headline})
    sys.exit(0 if code in (0, 5) and not outcomes["failed"] + outcomes["error"] else 1)


if __name__ == "__main__":
    main()
    gc.freeze()  # exit skips sweeping every module's objects (~1.5 s a phase)
