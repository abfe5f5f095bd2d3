"""Live memory per device: what the allocator and the device say, and what the shard holds."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceMemory:
    device: str
    shard_bytes: int  # parameters and buffers the shard placed on this device
    allocated: int | None = None  # CUDA caching allocator: bytes in live tensors
    reserved: int | None = None  # ... bytes held from the driver
    peak: int | None = None  # ... highest `allocated` since the last reset
    free: int | None = None  # the device's free bytes (all processes); on CPU the host's available RAM
    total: int | None = None  # on CPU: the host's RAM
    resident: int | None = None  # on CPU: the whole process's resident bytes (the shard's are part of it)


def read_memory(device: str, shard_bytes: int) -> DeviceMemory:
    """One reading. On CPU there is no allocator to ask: the host's RAM and the process's
    resident bytes stand in (the process RSS is not split per device)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        free, total = host_memory()
        return DeviceMemory(device, shard_bytes, free=free, total=total, resident=resident_bytes())
    free, total = torch.cuda.mem_get_info(dev)
    return DeviceMemory(
        device,
        shard_bytes,
        allocated=torch.cuda.memory_allocated(dev),
        reserved=torch.cuda.memory_reserved(dev),
        peak=torch.cuda.max_memory_allocated(dev),
        free=free,
        total=total,
    )


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of the host's RAM, from /proc/meminfo."""
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


KERNEL_CACHE_ENTRIES = 256  # oneDNN's compiled CPU kernels kept (PyTorch's default: 1024)


def bound_kernel_cache(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap oneDNN's primitive cache, unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set already.

    It keeps a JIT-compiled kernel per convolution shape and row count, and nothing can empty
    it: after 40 distinct sizes on the built-in model its 1024 entries held the process ~50 MiB
    above its warm size after every trim (RSS 1.128x the warm size; 1.083x at 256 entries, 1.064x
    with none), while 24 shapes in turn ran within 1.5% of the default (16.87 vs 16.64 s).
    oneDNN reads the variable at its first kernel: call this before anything runs a convolution.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))


def retain_freed_host_memory() -> bool:
    """Ask glibc to keep freed activation memory for reuse rather than hand it back to the OS.

    A CPU forward allocates and frees MiB-sized activations; by default glibc unmaps or trims
    them and the next forward page-faults them back in: forwards slower and steadier kept
    (`benchmarks/serving/host_memory.py` measures it; docs/serving.md has figures, with their
    host). What it keeps after a burst of odd sizes is no more than glibc keeps by default;
    `release_freed_host_memory` gives that back. Process-wide; returns False where the C library is not glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    trim = libc.mallopt(_M_TRIM_THRESHOLD, 2**30)
    return bool(trim and libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX))


def release_freed_host_memory() -> int:
    """Hand the memory glibc kept for reuse back to the OS (`malloc_trim(0)`); returns the resident
    bytes that went back (0 where the C library is not glibc).

    Freed memory inside the heap and in other threads' arenas stays resident whatever the
    thresholds: after 40 distinct sizes the built-in model's process kept +125-134 MiB over its
    warm size with glibc's defaults, a 64 MiB or a 1 GiB trim threshold alike, and never gave it
    back; only `malloc_trim(0)` reaches it (+58 MiB left: oneDNN's kernels per shape, see
    `bound_kernel_cache`). It
    took 17-25 ms; the next generation page-faults its working set back once (~4000 faults,
    ~20 ms of kernel time), then runs fault-free again. So the step loop calls this when it goes
    idle (`serving/housekeeping.py`), and the thresholds keep their speed while it works.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return 0
    before = resident_bytes()
    libc.malloc_trim(0)
    return max(0, before - resident_bytes())
