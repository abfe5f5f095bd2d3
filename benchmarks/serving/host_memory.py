"""What glibc's malloc settings cost and keep: warm generation time and resident memory after a
burst of distinct sizes, on the built-in model (CPU, float32, torch's default threads).

`retain_freed_host_memory()` raises glibc's trim threshold to 1 GiB and pins the mmap threshold
at 32 MiB so that freed activations are reused instead of page-faulted back in; the price is
memory the process keeps after a burst of odd sizes. mallopt is process-wide, so each variant
runs in its own subprocess; the variants' processes alternate, repeated, and ratios are taken
between processes of the same repetition. Each process:

1. loads the model, warms up, measures generations at the native size → `warm_*`, `rss_warm`;
2. generates 40 distinct sizes (multiples of 8 in 64..128 px, few steps) → `rss_burst`;
3. variants with `release`: `release_freed_host_memory()` (malloc_trim) → `rss_released`;
4. measures native generations again → `after_first_*`, `after_*`, `rss_after`;
5. an explicit `malloc_trim(0)` in every variant → `rss_trimmed`;
6. measures warm generations at 128 px, whose activations outgrow glibc's default thresholds
   → `large_*`.

Each generation is measured in wall seconds and, since the machine is shared and other tenants
can stretch wall time many times over, in what they cannot inflate much: this process's CPU and
kernel seconds and its minor page faults (the cost that retaining freed memory avoids).

One JSON object per process, then a summary, on stdout; a table on stderr.

    python -m benchmarks.serving.host_memory [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from itertools import product

import torch

MIB = 2**20
STEPS = 10  # a warm generation at the native size
LARGE, LARGE_STEPS = 128, 5  # the largest size the service takes by default (4x the native area)
BURST_STEPS = 2
BURST_SIZES = list(product(range(64, 129, 8), repeat=2))[::2][:40]  # 40 distinct (width, height)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
VARIANTS: dict[str, dict] = {
    "glibc_defaults": {},
    "trim_1gib": {"retain": True},  # the current retain_freed_host_memory()
    "trim_64mib": {"mallopt": {M_TRIM_THRESHOLD: 64 * MIB, M_MMAP_THRESHOLD: 32 * MIB}},
    "trim_1gib_release": {"retain": True, "release": True},
}
BASELINE = "glibc_defaults"
TIMED = [
    f"{phase}_{k}"
    for phase in ("warm", "after_first", "after", "large")
    for k in ("wall_s", "cpu_s", "sys_s", "faults")
]


def worker(variant: str, rounds: int) -> dict:
    """One variant, in this process: steps 1-5 of the module's docstring."""
    from server.engine.hardware.memory import (
        release_freed_host_memory,
        resident_bytes,
        retain_freed_host_memory,
    )
    from server.engine.runtime.pool import ActivationPool, default_pool_budgets
    from server.pipeline import Pipeline
    from server.requests import GenerationRequest

    settings = VARIANTS[variant]
    libc = ctypes.CDLL("libc.so.6")
    if settings.get("retain"):
        retain_freed_host_memory()
    for param, value in settings.get("mallopt", {}).items():
        libc.mallopt(param, value)

    pipeline = Pipeline.load(devices="cpu", pool=ActivationPool(default_pool_budgets(["cpu"])))

    def generate(seed: int, steps: int = STEPS, size: tuple[int, int] | None = None) -> dict[str, float]:
        width, height = size or (None, None)
        request = GenerationRequest("a red circle", seed=seed, steps=steps, width=width, height=height)
        return measured(lambda: pipeline.generate([request]))

    def mib() -> float:
        return round(resident_bytes() / MIB, 1)

    for seed in range(2):
        generate(seed)
    row: dict = {"variant": variant, **medians("warm", [generate(seed) for seed in range(rounds)])}
    row["rss_warm_mib"] = mib()
    for i, size in enumerate(BURST_SIZES):
        generate(i, BURST_STEPS, size)
    row["rss_burst_mib"] = mib()
    if settings.get("release"):
        start = time.perf_counter()
        release_freed_host_memory()
        row["release_ms"] = (time.perf_counter() - start) * 1e3
        row["rss_released_mib"] = mib()
    after = [generate(seed) for seed in range(rounds)]
    row |= {f"after_first_{k}": v for k, v in after[0].items()} | medians("after", after)
    row["rss_after_mib"] = mib()
    libc.malloc_trim(0)
    row["rss_trimmed_mib"] = mib()
    row["pool_idle_bytes"] = pipeline.pool.stats()["cpu"].bytes_idle
    generate(0, LARGE_STEPS, (LARGE, LARGE))
    row |= medians("large", [generate(seed, LARGE_STEPS, (LARGE, LARGE)) for seed in range(rounds)])
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def measured(run: Callable[[], object]) -> dict[str, float]:
    """Wall seconds, and what the machine's other tenants cannot inflate much: this process's
    CPU and kernel seconds (page faults are kernel time) and its minor page faults."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_s": wall,
        "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "sys_s": after.ru_stime - before.ru_stime,
        "faults": after.ru_minflt - before.ru_minflt,
    }


def medians(phase: str, runs: list[dict[str, float]]) -> dict[str, float]:
    return {f"{phase}_{k}": statistics.median(r[k] for r in runs) for k in runs[0]}


def run_variant(variant: str, rounds: int) -> dict:
    worker = ["--worker", variant, "--rounds", str(rounds)]
    command = [sys.executable, "-m", "benchmarks.serving.host_memory", *worker]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rows: list[dict], repeats: int, rounds: int) -> dict:
    by_variant: dict[str, list[dict]] = {name: [r for r in rows if r["variant"] == name] for name in VARIANTS}
    base = by_variant[BASELINE]

    def median(name: str, field: str) -> float | None:
        values = [r[field] for r in by_variant[name] if field in r]
        return round(statistics.median(values), 4) if values else None

    variants = {}
    for name, runs in by_variant.items():
        variants[name] = {
            **{
                f"{field}_ratio_vs_defaults": round(
                    statistics.median(r[field] / b[field] for r, b in zip(runs, base, strict=True)), 3
                )
                for field in ("warm_wall_s", "warm_cpu_s", "large_wall_s", "large_cpu_s")
            },
            **{field: median(name, field) for field in TIMED},
            # growth over the warm process: what the burst left behind, at each reading
            **{
                f"{field}_over_warm_mib": round(
                    statistics.median(r[f"rss_{field}_mib"] - r["rss_warm_mib"] for r in runs), 1
                )
                for field in ("burst", "released", "after", "trimmed")
                if all(f"rss_{field}_mib" in r for r in runs)
            },
            "rss_warm_mib": median(name, "rss_warm_mib"),
            "release_ms": median(name, "release_ms"),
        }
    return {
        "summary": True,
        "variants": {n: {k: v for k, v in d.items() if v is not None} for n, d in variants.items()},
        "config": {
            "model": "built-in (diffshard-shapes), cpu, float32",
            "steps": STEPS,
            "large": f"{LARGE}x{LARGE} px, {LARGE_STEPS} steps",
            "timed_rounds_per_phase": rounds,
            "repeats_per_variant": repeats,
            "burst": f"{len(BURST_SIZES)} sizes, {BURST_STEPS} steps each",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 process per variant, 3 rounds: a smoke test")
    parser.add_argument("--repeats", type=int, help="processes per variant (default 3, 1 with --quick)")
    parser.add_argument("--rounds", type=int, help="timed generations per phase (default 9, 3 with --quick)")
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 9)
    if args.worker:
        print(json.dumps(worker(args.worker, rounds)), flush=True)
        return 0
    repeats = args.repeats or (1 if args.quick else 3)
    rows = []
    for repeat in range(repeats):
        for variant in VARIANTS:
            row = run_variant(variant, rounds) | {"repeat": repeat}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = summarize(rows, repeats, rounds)
    print(json.dumps(summary), flush=True)

    print(
        f"\n{'variant':<18} {'wall s':>7} {'ratio':>6} {'faults':>7} {'128px s':>8} {'ratio':>6} "
        f"{'sys ms':>7} {'faults':>7} {'burst+':>7} {'release+':>9} {'after+':>7} {'trim+':>6}"
        "\n(medians: wall and faults per generation, native then 128 px; MiB over the warm RSS)",
        file=sys.stderr,
    )
    for name, v in summary["variants"].items():
        print(
            f"{name:<18} {v['warm_wall_s']:>7.3f} {v['warm_wall_s_ratio_vs_defaults']:>6.3f} "
            f"{v['warm_faults']:>7.0f} {v['large_wall_s']:>8.3f} {v['large_wall_s_ratio_vs_defaults']:>6.3f} "
            f"{v['large_sys_s'] * 1e3:>7.1f} {v['large_faults']:>7.0f} {v['burst_over_warm_mib']:>7.1f} "
            f"{v.get('released_over_warm_mib', float('nan')):>9.1f} {v['after_over_warm_mib']:>7.1f} "
            f"{v['trimmed_over_warm_mib']:>6.1f}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
