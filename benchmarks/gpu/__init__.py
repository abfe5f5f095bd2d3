"""The GPU check's parts (`python -m benchmarks.gpu_check` runs them): the bundle of wheels the
device lacks, and one module per phase, each a child process writing JSON lines (`Lines`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


class Lines:
    """A phase's results, one JSON object a line, flushed as each is written: a phase killed at
    its time limit keeps every line before the kill."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, result: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(result, default=str) + "\n")
        print(json.dumps(result, default=str), flush=True)  # the phase's log, too


def phase_parser(description: str | None) -> argparse.ArgumentParser:
    """The arguments every phase takes from `gpu_check`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lines", type=Path, required=True, help="the JSON-lines file to append to")
    return parser
