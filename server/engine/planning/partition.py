"""Splitting blocks, in execution order, into contiguous runs, one per device: pure functions."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from server.errors import PlanError


def even_split(names: list[str], devices: list[str]) -> list[tuple[str, list[str]]]:
    """Equal block counts; the first `len(names) % n` stages take one block more."""
    n = min(len(devices), len(names))
    base, extra = divmod(len(names), n)
    lengths = [base + (1 if i < extra else 0) for i in range(n)]
    return stages_from_cuts(names, devices, lengths)


def explicit_split(names: list[str], device_map: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    unknown = sorted(set(device_map) - set(names))
    if unknown:
        raise PlanError(f"device_map names unknown blocks {unknown}; the blocks are {names}")
    missing = [n for n in names if n not in device_map]
    if missing:
        raise PlanError(f"device_map is missing blocks {missing}: every block needs a device")
    stages: list[tuple[str, list[str]]] = []
    for name in names:  # contiguous runs on one device form a stage
        if stages and stages[-1][0] == device_map[name]:
            stages[-1][1].append(name)
        else:
            stages.append((device_map[name], [name]))
    return stages


def stages_from_cuts(
    names: list[str], devices: list[str], lengths: Sequence[int]
) -> list[tuple[str, list[str]]]:
    stages, start = [], 0
    for device, length in zip(devices, lengths, strict=False):
        if length:
            stages.append((device, names[start : start + length]))
        start += length
    return stages


def min_max_partition(
    weights: Sequence[Sequence[float]], sizes: Sequence[int], capacities: Sequence[float]
) -> list[int] | None:
    """Split blocks, in order, into one run per device minimising the heaviest run.

    `weights[k]` are the blocks' weights on device k (a block may cost more on a slower
    device). Each run's `sizes` must fit its device's capacity; runs may be empty only where
    that is needed. Returns run lengths, or None when nothing fits. O(devices · blocks²).
    """
    n, d = len(sizes), len(capacities)
    prefix_w = []
    for row in weights:
        prefix_w.append([0.0])
        for w in row:
            prefix_w[-1].append(prefix_w[-1][-1] + w)
    prefix_s = [0]
    for s in sizes:
        prefix_s.append(prefix_s[-1] + s)
    # best[k][i]: (heaviest run, -runs used) placing the first i blocks on the first k devices
    inf = (math.inf, 0)
    best = [[inf] * (n + 1) for _ in range(d + 1)]
    choice = [[0] * (n + 1) for _ in range(d + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, d + 1):
        for i in range(n + 1):
            for j in range(i + 1):  # device k-1 takes blocks j..i-1
                prev = best[k - 1][j]
                if prev[0] == math.inf or prefix_s[i] - prefix_s[j] > capacities[k - 1]:
                    continue
                load = prefix_w[k - 1][i] - prefix_w[k - 1][j]
                value = (max(prev[0], load), prev[1] - (1 if i > j else 0))
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    if best[d][n][0] == math.inf:
        return None
    lengths, i = [], n
    for k in range(d, 0, -1):
        j = choice[k][i]
        lengths.append(i - j)
        i = j
    return lengths[::-1]
