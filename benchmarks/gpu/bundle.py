"""`make gpu-bundle`: the wheels the GPU machine lacks, downloaded into .gpu/ for the lent machine.

The lent GPU machine has no network: what its image lacks (image.txt) travels with the working
tree as wheels, and everything tracked travels with every call, within 64 MiB. So this downloads
bundle.txt's pins for CPython 3.12 on manylinux x86_64 (binary wheels only, no dependencies
resolved: bundle.txt names each one), drops wheels no pin names, and fails when the wheels plus
the tree that travels are over `LIMIT_MIB` (2 MiB under the carry limit, for $OUT's round trip
and the files a session adds).

    python -m benchmarks.gpu.bundle [--dest .gpu]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PINS = HERE / "bundle.txt"
IMAGE = HERE / "image.txt"
LIMIT_MIB = 62
MIB = 2**20
# pip matches a manylinux tag exactly: these cover the wheels bundle.txt pins
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares them (`Typing_Extensions` is `typing-extensions`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> dict[str, str | None]:
    """name → pinned version (None where unpinned) of a requirements-style list, comments dropped."""
    entries: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            entries[normalize(name)] = version or None
    return entries


def wheel_name(file: Path) -> str:
    """The distribution a wheel file holds (`pydantic_core-2.50.5-cp312-...whl` → `pydantic-core`)."""
    return normalize(file.name.split("-", 1)[0])


def travelling_bytes() -> int:
    """Bytes of the files that travel with every call: tracked and untracked-not-ignored ones."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sum((ROOT / p).stat().st_size for p in listed.split("\0") if p and (ROOT / p).is_file())


def download(dest: Path) -> None:
    pins = [f"{name}=={version}" for name, version in read_list(PINS).items()]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "--dest",
            str(dest),
            *pins,
        ],
        check=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    download(args.dest)
    pinned = read_list(PINS)
    for stale in (f for f in args.dest.glob("*.whl") if wheel_name(f) not in pinned):
        stale.unlink()  # an older pin's wheel: two versions of one package stop the install there
    wheels = sorted(args.dest.glob("*.whl"))
    missing = sorted(set(pinned) - {wheel_name(w) for w in wheels})
    bundle = sum(w.stat().st_size for w in wheels)
    tree = travelling_bytes()
    summary = {
        "wheels": {w.name: round(w.stat().st_size / MIB, 2) for w in wheels},
        "bundle_mib": round(bundle / MIB, 1),
        "tree_mib": round(tree / MIB, 1),
        "total_mib": round((bundle + tree) / MIB, 1),
        "limit_mib": LIMIT_MIB,
        "missing": missing,
        "fits": bundle + tree <= LIMIT_MIB * MIB and not missing,
    }
    print(json.dumps(summary, indent=1))
    if missing:
        print(f"gpu-bundle: no wheel for {', '.join(missing)}", file=sys.stderr)
    elif not summary["fits"]:
        print(
            f"gpu-bundle: {summary['total_mib']} MiB would travel with every call, over {LIMIT_MIB} MiB: "
            "leave a wheel out (bundle.txt) or untrack large files",
            file=sys.stderr,
        )
    return 0 if summary["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
