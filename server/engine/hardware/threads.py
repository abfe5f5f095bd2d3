"""How many CPU threads this process should run: the CPUs it may really use, not the host's.

torch sizes its intra-op pool from the host's cores. In a container limited to 2 CPUs on a
64-core host that is 64 threads time-sliced onto 2 CPUs' worth of quota: every parallel region
waits for descheduled threads and the cgroup throttles the whole process. The usable count is
the smaller of the CPUs the scheduler lets us run on (affinity: `taskset`, cpusets) and the
CPU time the cgroup grants per period (`docker --cpus`, Kubernetes `limits.cpu`).

The kernel's files are the boundary: their paths are parameters, so tests point them at files
they write.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cpu_quota(
    v2_max: Path = CGROUP_V2_MAX,
    v1_quota: Path = CGROUP_V1_QUOTA,
    v1_period: Path = CGROUP_V1_PERIOD,
) -> int:
    """The CPUs this process may use: min(affinity, cgroup quota), at least 1.

    A quota of 150000 µs per 100000 µs period rounds up to 2: the second thread still gets half
    a CPU of useful time, and rounding down would leave a quota of 0.5 with no thread at all.
    Missing or unreadable files (no cgroup, another layout) and "max" / -1 mean no quota.
    """
    cpus = len(os.sched_getaffinity(0))
    quotas = [q for q in (_v2_quota(v2_max), _v1_quota(v1_quota, v1_period)) if q is not None]
    return max(1, min([cpus, *quotas]))


def fit_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to `threads`, or to `cpu_quota()` when None; returns the number."""
    count = threads or cpu_quota()
    set_intra_op_threads(count)
    return count


def set_intra_op_threads(count: int) -> None:
    """This thread's torch intra-op threads, set so they stay set.

    torch (OpenMP) gives each thread its count lazily, at its first parallel op, from the value
    the process last set on any thread; `torch.set_num_threads` alone does not count as that
    first time. A lane that set 1 thread, then ran its first op after another thread set 2, ran
    at 2 ever after: two lanes' oneDNN calls woke each other's cores on every op (the built-in
    model's lone image 0.55 s instead of 0.33). Reading the count first makes the init happen
    here."""
    torch.get_num_threads()
    torch.set_num_threads(count)


def take_thread(threads: int | None, device: torch.device) -> None:
    """This thread, for good: `threads` intra-op threads (None: unchanged; a CPU worker's share of
    the cores) and, on a GPU, `device` as its current CUDA device (its handles, workspaces and
    default stream there, not on GPU 0)."""
    if threads is not None:
        set_intra_op_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """This thread's torch intra-op threads set to `threads` (None: unchanged) while it runs."""
    before = torch.get_num_threads()  # also this thread's lazy init (`set_intra_op_threads`)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(before)


def _v2_quota(path: Path) -> int | None:
    """cgroup v2 `cpu.max`: "max 100000" (no quota) or "200000 100000" (quota, period in µs)."""
    fields = _read(path)
    if fields is None or len(fields) != 2 or fields[0] == "max":
        return None
    return _ceil_ratio(fields[0], fields[1])


def _v1_quota(quota_path: Path, period_path: Path) -> int | None:
    """cgroup v1 `cpu.cfs_quota_us` (-1: no quota) over `cpu.cfs_period_us`."""
    quota, period = _read(quota_path), _read(period_path)
    if not quota or not period:
        return None
    return _ceil_ratio(quota[0], period[0])


def _ceil_ratio(quota: str, period: str) -> int | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return math.ceil(q / p) if q > 0 and p > 0 else None


def _read(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except OSError:
        return None
