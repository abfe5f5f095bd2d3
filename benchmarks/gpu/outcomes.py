"""A pytest plugin (`-p benchmarks.gpu.outcomes`): each test's outcome appended as a JSON line to
$GPU_CHECK_LINES the moment it is known, so a run killed at its time limit keeps every outcome
before the kill (a JUnit file is written only at the end)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.gpu import Lines


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # a test's outcome is its call's, or its setup's when that failed or skipped, plus a failed teardown
    if report.when == "call" or (report.when != "call" and report.outcome != "passed"):
        result = {
            "test": report.nodeid,
            "outcome": "error" if report.when != "call" and report.failed else report.outcome,
            "seconds": round(report.duration, 2),
        }
        if report.skipped and isinstance(report.longrepr, tuple):
            result["reason"] = report.longrepr[2]
        elif report.failed:
            result["message"] = report.longreprtext[-1500:]
        Lines(Path(os.environ["GPU_CHECK_LINES"])).write(result)
