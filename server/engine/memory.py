"""Live memory per device: what the allocator and the device say, and what the shard holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceMemory:
    device: str
    shard_bytes: int  # parameters and buffers the shard placed on this device
    allocated: int | None = None  # CUDA caching allocator: bytes in live tensors
    reserved: int | None = None  # ... bytes held from the driver
    peak: int | None = None  # ... highest `allocated` since the last reset
    free: int | None = None  # the device's free bytes (all processes)
    total: int | None = None


def read_memory(device: str, shard_bytes: int) -> DeviceMemory:
    """One reading; on CPU only the shard's own bytes are known (the process RSS is not per device)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return DeviceMemory(device, shard_bytes)
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
