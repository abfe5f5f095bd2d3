"""ActivationPool: rent a request's tensors and return them, with per-request scopes.

PyTorch's caching allocator already reuses device memory; what the pool adds is accounting
(bytes per device, hits and misses), a byte budget per device with least-recently-returned
eviction of idle buffers, pinned host buffers for device→host copies, and scopes: everything
a request rented goes back when the request ends, fails or is cancelled.

    with pool.scope() as scope:
        latents = scope.rent((2, 4, 64, 64), torch.float32, "cuda:0")
        ...  # on exit every buffer the scope still holds is returned, whatever happened

A rented buffer is uninitialised (as `torch.empty`) and belongs to one holder until it is
returned; holding on to it after that is a bug the pool cannot see.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

Key = tuple[tuple[int, ...], torch.dtype, str, bool]  # shape, dtype, device, pinned


class PoolExhausted(MemoryError):
    """A rent that would take a device's pool over its byte budget, even with nothing idle."""


@dataclass(frozen=True)
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_pooled: int = 0  # idle + in use: everything the pool has allocated and kept
    bytes_in_use: int = 0

    @property
    def hit_rate(self) -> float:
        rents = self.hits + self.misses
        return self.hits / rents if rents else 0.0


class ActivationPool:
    """Thread-safe pool of tensors keyed exactly by (shape, dtype, device, pinned)."""

    def __init__(self, budgets: Mapping[str, int] | None = None) -> None:
        self._budgets = {str(torch.device(d)): b for d, b in (budgets or {}).items()}
        self._lock = threading.Lock()
        self._idle: dict[str, OrderedDict[int, tuple[Key, torch.Tensor]]] = {}  # per device, LRU first
        self._in_use: dict[int, tuple[Key, torch.Tensor]] = {}
        self._stats: dict[str, dict[str, int]] = {}  # per device: PoolStats' fields

    def rent(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: str | torch.device,
        *,
        pinned: bool = False,
    ) -> torch.Tensor:
        """A buffer of exactly this shape, dtype and device that no one else holds.

        `pinned=True` asks for page-locked host memory (fast, async device→host copies);
        without CUDA it is ordinary host memory.
        """
        device = str(torch.device(device))
        pinned = pinned and device == "cpu" and torch.cuda.is_available()
        key: Key = (tuple(shape), dtype, device, pinned)
        nbytes = _nbytes(key)
        with self._lock:
            idle = self._idle.setdefault(device, OrderedDict())
            stats = self._stats.setdefault(device, dict.fromkeys(PoolStats.__dataclass_fields__, 0))
            found = next((i for i in reversed(idle) if idle[i][0] == key), None)  # warmest match
            if found is not None:
                tensor = idle.pop(found)[1]
                stats["hits"] += 1
            else:
                self._make_room(device, nbytes)
                tensor = torch.empty(key[0], dtype=dtype, device=device, pin_memory=pinned)
                stats["misses"] += 1
                stats["bytes_pooled"] += nbytes
            self._in_use[id(tensor)] = (key, tensor)
            stats["bytes_in_use"] += nbytes
            return tensor

    def give_back(self, tensor: torch.Tensor) -> None:
        """Return a rented buffer; it may be handed to the next renter at once."""
        with self._lock:
            entry = self._in_use.pop(id(tensor), None)
            if entry is None or entry[1] is not tensor:
                raise ValueError("this tensor was not rented from this pool, or was already returned")
            device = entry[0][2]
            self._idle[device][id(tensor)] = entry
            self._stats[device]["bytes_in_use"] -= _nbytes(entry[0])

    @contextmanager
    def scope(self) -> Iterator[PoolScope]:
        """A request's rentals: all returned on exit, however the block ends."""
        scope = PoolScope(self)
        try:
            yield scope
        finally:
            scope.close()

    def stats(self) -> dict[str, PoolStats]:
        with self._lock:
            return {device: PoolStats(**counters) for device, counters in self._stats.items()}

    def clear(self) -> None:
        """Drop every idle buffer (e.g. after an out-of-memory error)."""
        with self._lock:
            for device, idle in self._idle.items():
                while idle:
                    self._evict(device)

    def _make_room(self, device: str, nbytes: int) -> None:
        """Evict least recently returned idle buffers until `nbytes` more fit the budget."""
        budget = self._budgets.get(device)
        if budget is None:
            return
        stats = self._stats[device]
        while stats["bytes_pooled"] + nbytes > budget and self._idle[device]:
            self._evict(device)
        if stats["bytes_pooled"] + nbytes > budget:
            raise PoolExhausted(
                f"activation pool on {device}: {nbytes} more bytes would exceed its budget of "
                f"{budget} bytes ({stats['bytes_in_use']} in use)"
            )

    def _evict(self, device: str) -> None:
        key, _ = self._idle[device].popitem(last=False)[1]
        self._stats[device]["evictions"] += 1
        self._stats[device]["bytes_pooled"] -= _nbytes(key)


class PoolScope:
    """What one request rented; see `ActivationPool.scope`."""

    def __init__(self, pool: ActivationPool) -> None:
        self._pool = pool
        self._held: dict[int, torch.Tensor] = {}

    def rent(
        self, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device, *, pinned: bool = False
    ) -> torch.Tensor:
        tensor = self._pool.rent(shape, dtype, device, pinned=pinned)
        self._held[id(tensor)] = tensor
        return tensor

    def give_back(self, tensor: torch.Tensor) -> None:
        """Return one buffer early."""
        if self._held.pop(id(tensor), None) is None:
            raise ValueError("this tensor was not rented in this scope")
        self._pool.give_back(tensor)

    @property
    def held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        while self._held:
            self._pool.give_back(self._held.popitem()[1])


def _nbytes(key: Key) -> int:
    return math.prod(key[0]) * key[1].itemsize
