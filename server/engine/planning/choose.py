"""Which candidate a plan runs, and why (`planner.py` weighs them).

Throughput under load first: among the candidates within NEAR of the fastest, the one quicker
for a lone image (and among those within NEAR of that, the fewest threads a CPU worker). A lone
image is what a lightly loaded server sees, and how it runs is part of every candidate: under
load each replica steps its own lane's requests, and a lone request goes to the replicas with
nothing to do as well, its rows split over them (a guided image's two halves) or, for a DiT, its
tokens (a sequence group), whichever is predicted quickest
(`Candidate.lone_step_s`). So `auto` never trades throughput for lone latency: it gets both
from the same replicas. `--parallel sequence` asks for every call to be a group (one lane).

On CPU workers under auto, never a candidate that leaves cores idle when one that fills them fits.
"""

from __future__ import annotations

from typing import Any

from server.engine.planning.parallel import Candidate, Parallel, fill_cores
from server.errors import PlanError

NEAR = 0.05  # predictions this close in throughput are a tie: the lower lone latency wins


def choose(
    search: Any,
    baselines: list[Candidate],
    parallel: Parallel,
    whole: bool,
    device_list: list[str],
    costs_note: str,
) -> tuple[Candidate, str]:
    """The candidate to run and why: throughput first; among those within NEAR of the fastest,
    the quicker lone image; on a CPU under auto, never one that leaves cores idle."""
    base = {id(c) for c in baselines}
    choosable = [c for c in search.candidates if c.rows_per_s is not None and id(c) not in base]
    if parallel == Parallel.AUTO:  # never more busy CPU workers than cores, unless asked for
        choosable = [c for c in choosable if id(c) not in search.crowded]
        choosable += [c for c in baselines if c.rows_per_s is not None]
    if not choosable:
        if not whole:  # the layer split's own refusal names the device and the shortfall
            search.one_worker(Parallel.OFF, costs_note)
        notes = "; ".join(f"{c.label}: {c.note}" for c in search.candidates)
        raise PlanError(f"no {parallel} configuration over {device_list} fits: {notes}")
    idle = ""
    if search.all_cpu and parallel == Parallel.AUTO:
        busy = fill_cores(choosable, search.quota)
        faster = max((c for c in choosable if all(c is not b for b in busy)), key=rate, default=None)
        if busy and faster is not None and rate(faster) > max(map(rate, busy)):
            idle = f"; {faster.label} ({faster.note}) is predicted faster but leaves cores idle"
        choosable = busy or choosable
    top = max(map(rate, choosable))
    near = [c for c in choosable if rate(c) >= top * (1 - NEAR)]
    quickest = min(map(lone, near))
    alone = [c for c in near if lone(c) <= quickest * (1 + NEAR)]
    # a tie again: the fewest threads a CPU worker. Counted costs take intra-op threads to scale
    # perfectly, and they do not (memory-bound kernels, synchronization): the SD-1.5 UNet's frozen
    # bf16 step at 512², one row on each of two 1-thread replicas 2339 ms, both rows on one
    # 2-thread replica 2994 ms (2-core EPYC), where the two were predicted within 4%
    best = min(alone, key=lambda c: (c.threads or 0, lone(c)))
    tie = " (or as fast, and quicker alone)" if len(near) > 1 else ""
    tie = " (or as fast and as quick alone, with fewer threads a worker)" if len(alone) > 1 else tie
    reason = f"{best.label} is predicted fastest{tie} ({best.rows_per_s:.3g} rows/s under load"
    baseline = baselines[0] if baselines else None
    if best is not baseline and baseline is not None and baseline.rows_per_s:
        reason += f"; {best.rows_per_s / baseline.rows_per_s:.2f}× {baseline.note}"
    reason += idle
    reason += ")" if parallel == Parallel.AUTO else f"; --parallel {parallel} asked for it)"
    return best, reason


def rate(candidate: Candidate) -> float:
    return candidate.rows_per_s or 0.0


def lone(candidate: Candidate) -> float:
    return candidate.lone_step_s if candidate.lone_step_s is not None else float("inf")
