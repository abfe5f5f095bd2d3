"""ActivationPool: rent a request's tensors and return them, with per-request scopes.

PyTorch's caching allocator already reuses device memory; what the pool adds is accounting
(bytes per device, hits and misses), pinned host buffers for device→host copies, scopes
(everything a request rented goes back when the request ends, fails or is cancelled) and a
bound on what it keeps IDLE per device.

    with pool.scope() as scope:
        latents = scope.rent((2, 4, 64, 64), torch.float32, "cuda:0")
        ...  # on exit every buffer the scope still holds is returned, whatever happened

The budget bounds idle bytes only. Rented memory is the requests' own (admission and the
service's limits bound it); refusing a rent would fail a request the service already accepted,
while idle buffers are the pool's choice and only worth keeping while they are likely to be
rented again. Without a bound every distinct request shape left its buffers behind for good
(200 widths: 200 idle buffers, 118 MiB). So, per device, idle buffers are evicted least recently
returned first until idle bytes fit the budget; `trim` also drops buffers idle for long (the
step loop calls it when it has nothing to do).

Idle buffers are indexed by their exact key, so a rent is a dict lookup whatever else is idle,
and each device keeps one LRU order of its idle buffers for eviction.

A rented buffer is uninitialised (as `torch.empty`) and belongs to one holder until it is
returned; holding on to it after that is a bug the pool cannot see.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from server.engine.hardware.memory import host_memory

Key = tuple[tuple[int, ...], torch.dtype, str, bool]  # shape, dtype, device, pinned
ANY_DEVICE = "*"  # a budget under this key applies to every device not named
HOST_POOL_SHARE = 0.05  # default idle budget on "cpu": this share of the host's RAM
# ... on a CUDA device: this share of its total memory, at most DEVICE_POOL_MAX; held inside the
# planner's margin (`devices.CUDA_MARGIN`, 10%), which the plan never fills (at 10% it could
# hold the whole margin idle)
DEVICE_POOL_SHARE = 0.02
DEVICE_POOL_MAX = 2**30
# Larger host buffers are not pinned: torch's host allocator keeps freed pinned blocks cached (and
# locked) for good, and a video's frames (hundreds of MB, one copy each) gain little from it.
MAX_PINNED_BYTES = 64 * 2**20


@dataclass(frozen=True)
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # idle buffers dropped: over the budget, by `trim` or by `clear`
    bytes_pooled: int = 0  # idle + in use: everything the pool has allocated and still tracks
    bytes_in_use: int = 0
    bytes_idle: int = 0  # returned and kept for the next renter: what the budget bounds

    @property
    def hit_rate(self) -> float:
        rents = self.hits + self.misses
        return self.hits / rents if rents else 0.0


def default_pool_budgets(devices: Iterable[str]) -> dict[str, int]:
    """Idle budgets for `devices`: 5% of the host's RAM for "cpu", 2% of each CUDA device's
    total memory up to 1 GiB.

    Enough to keep a busy service's working shapes warm (the built-in model's whole working
    set is a few MiB), small enough that a burst of odd shapes cannot hold a sizeable share of
    the machine. "cpu" is always included: pinned host buffers for device→host copies count
    there even when every stage runs on a GPU.
    """
    budgets = {"cpu": int(HOST_POOL_SHARE * host_memory()[1])}
    for name in devices:
        device = torch.device(name)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            budgets[f"cuda:{device.index or 0}"] = min(int(DEVICE_POOL_SHARE * total), DEVICE_POOL_MAX)
    return budgets


class ActivationPool:
    """Thread-safe pool of tensors keyed exactly by (shape, dtype, device, pinned).

    `budgets` maps a device ("cpu", "cuda:0", or "*" for every device not named) to the idle
    bytes it may keep; a device with no budget keeps everything returned. `clock` times idle
    buffers for `trim` (injectable for tests).
    """

    def __init__(
        self, budgets: Mapping[str, int] | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._budgets = {
            d if d == ANY_DEVICE else str(torch.device(d)): b for d, b in (budgets or {}).items()
        }
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: dict[Key, OrderedDict[int, torch.Tensor]] = {}  # per key, warmest last
        # per device: every idle buffer's key and when it was returned, least recently first
        self._lru: dict[str, OrderedDict[int, tuple[Key, float]]] = {}
        self._in_use: dict[int, tuple[Key, torch.Tensor]] = {}
        self._stats: dict[str, dict[str, int]] = {}  # per device: PoolStats' counters but bytes_pooled

    def rent(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: str | torch.device,
        *,
        pinned: bool = False,
    ) -> torch.Tensor:
        """A buffer of exactly this shape, dtype and device that no one else holds; never refused.

        `pinned=True` asks for page-locked host memory (fast, async device→host copies);
        without CUDA, or over MAX_PINNED_BYTES (a video's frames), it is ordinary host memory.
        """
        device = str(torch.device(device))
        nbytes = math.prod(shape) * dtype.itemsize
        pinned = pinned and device == "cpu" and torch.cuda.is_available() and nbytes <= MAX_PINNED_BYTES
        key: Key = (tuple(shape), dtype, device, pinned)
        with self._lock:
            stats = self._device_stats(device)
            idle = self._idle.get(key)
            if idle:
                tensor_id, tensor = idle.popitem()  # the warmest of its key
                if not idle:
                    del self._idle[key]  # distinct shapes must not leave empty entries behind
                del self._lru[device][tensor_id]
                stats["bytes_idle"] -= nbytes
                stats["hits"] += 1
            else:
                # Make room before allocating, so the allocator can reuse what is dropped and the
                # newcomer fits the budget once it is returned.
                self._fit(device, nbytes)
                tensor = torch.empty(key[0], dtype=dtype, device=device, pin_memory=pinned)
                stats["misses"] += 1
            self._in_use[id(tensor)] = (key, tensor)
            stats["bytes_in_use"] += nbytes
            return tensor

    def give_back(self, tensor: torch.Tensor) -> None:
        """Return a rented buffer; it may be handed to the next renter at once, or dropped if
        keeping it would take idle bytes over the device's budget."""
        with self._lock:
            entry = self._in_use.pop(id(tensor), None)
            if entry is None or entry[1] is not tensor:
                raise ValueError("this tensor was not rented from this pool, or was already returned")
            key = entry[0]
            device, nbytes = key[2], _nbytes(key)
            stats = self._stats[device]
            stats["bytes_in_use"] -= nbytes
            if not self._fit(device, nbytes):
                stats["evictions"] += 1  # kept idle it alone would exceed the budget
                return
            self._idle.setdefault(key, OrderedDict())[id(tensor)] = tensor
            self._lru.setdefault(device, OrderedDict())[id(tensor)] = (key, self._clock())
            stats["bytes_idle"] += nbytes

    def trim(self, idle_for_s: float) -> int:
        """Drop every buffer idle for longer than `idle_for_s` seconds; returns the bytes freed."""
        with self._lock:
            oldest_kept = self._clock() - idle_for_s
            freed = 0
            for device, lru in self._lru.items():
                while lru and next(iter(lru.values()))[1] < oldest_kept:
                    freed += self._evict(device)
            return freed

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
            return {
                device: PoolStats(**c, bytes_pooled=c["bytes_idle"] + c["bytes_in_use"])
                for device, c in self._stats.items()
            }

    def clear(self) -> None:
        """Drop every idle buffer (e.g. after an out-of-memory error)."""
        with self._lock:
            for device, lru in self._lru.items():
                while lru:
                    self._evict(device)

    def budget(self, device: str) -> int | None:
        """The idle bytes `device` may keep: its own budget, else "*"'s, else None (no bound)."""
        return self._budgets.get(device, self._budgets.get(ANY_DEVICE))

    def _device_stats(self, device: str) -> dict[str, int]:
        counters = (f for f in PoolStats.__dataclass_fields__ if f != "bytes_pooled")
        return self._stats.setdefault(device, dict.fromkeys(counters, 0))

    def _fit(self, device: str, nbytes: int) -> bool:
        """Evict least recently returned idle buffers until `nbytes` more idle bytes fit the
        budget; False (nothing evicted) when `nbytes` alone exceeds it: one outsized buffer
        must not flush a pool of warm ones."""
        budget = self.budget(device)
        if budget is None:
            return True
        if nbytes > budget:
            return False
        stats, lru = self._stats[device], self._lru.get(device)
        while lru and stats["bytes_idle"] + nbytes > budget:
            self._evict(device)
        return True

    def _evict(self, device: str) -> int:
        """Drop `device`'s least recently returned idle buffer; returns its bytes."""
        tensor_id, (key, _) = self._lru[device].popitem(last=False)
        idle = self._idle[key]
        del idle[tensor_id]
        if not idle:
            del self._idle[key]
        nbytes = _nbytes(key)
        self._stats[device]["evictions"] += 1
        self._stats[device]["bytes_idle"] -= nbytes
        return nbytes


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
