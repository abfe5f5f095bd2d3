"""ActivationPool: exact keys, scopes that always return, idle budgets with LRU eviction, trim, threads."""

from __future__ import annotations

import threading

import pytest
import torch

from server.engine.hardware.memory import host_memory
from server.engine.runtime.pool import ActivationPool, default_pool_budgets

F32 = torch.float32
SHAPES = [(2, 4, 8, 8), (2, 77, 32), (1, 3, 64, 64)]  # latents, context, image


def request(pool: ActivationPool) -> None:
    with pool.scope() as scope:
        for shape in SHAPES:
            scope.rent(shape, F32, "cpu").fill_(1.0)


def test_same_shape_requests_hit_after_warm_up_with_flat_pooled_bytes() -> None:
    pool = ActivationPool()
    request(pool)  # warm-up: 3 misses
    pooled = pool.stats()["cpu"].bytes_pooled
    for _ in range(100):
        request(pool)
        assert pool.stats()["cpu"].bytes_pooled == pooled
    stats = pool.stats()["cpu"]
    assert stats.hits / (stats.hits + stats.misses - 3) >= 0.99
    assert stats.misses == 3 and stats.bytes_in_use == 0


def test_keys_are_exact() -> None:
    pool = ActivationPool()
    a = pool.rent((2, 3), F32, "cpu")
    pool.give_back(a)
    b = pool.rent((3, 2), F32, "cpu")  # same bytes, another shape: a miss
    c = pool.rent((2, 3), torch.bfloat16, "cpu")
    assert b is not a and c is not a
    d = pool.rent((2, 3), F32, "cpu")
    assert d is a
    assert pool.stats()["cpu"].hits == 1


def test_an_exception_mid_request_returns_every_buffer() -> None:
    pool = ActivationPool()
    with pytest.raises(RuntimeError, match="boom"), pool.scope() as scope:
        for shape in SHAPES:
            scope.rent(shape, F32, "cpu")
        raise RuntimeError("boom")
    stats = pool.stats()["cpu"]
    assert stats.bytes_in_use == 0 and stats.bytes_pooled > 0
    request(pool)
    assert pool.stats()["cpu"].hits == len(SHAPES)


def test_returning_twice_or_a_stranger_is_refused() -> None:
    pool = ActivationPool()
    t = pool.rent((4,), F32, "cpu")
    pool.give_back(t)
    with pytest.raises(ValueError, match="not rented from this pool"):
        pool.give_back(t)
    with pytest.raises(ValueError, match="not rented from this pool"):
        pool.give_back(torch.empty(4))


KIB = 1024


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kib(pool: ActivationPool, n: int = 1) -> torch.Tensor:
    return pool.rent((256 * n,), F32, "cpu")  # n KiB


def test_budget_bounds_idle_bytes_and_never_refuses_a_rent() -> None:
    pool = ActivationPool(budgets={"cpu": 3 * KIB})
    held = [kib(pool) for _ in range(8)]  # 8 KiB in use, over the budget: still granted
    stats = pool.stats()["cpu"]
    assert stats.bytes_in_use == 8 * KIB and stats.bytes_idle == 0 and stats.evictions == 0
    for tensor in held:
        pool.give_back(tensor)
    stats = pool.stats()["cpu"]
    assert stats.bytes_idle == 3 * KIB and stats.bytes_pooled == 3 * KIB and stats.evictions == 5
    kept = [kib(pool) for _ in range(3)]
    assert all(x is y for x, y in zip(kept, held[:-4:-1], strict=True))  # the last returned, warmest first


def test_eviction_is_least_recently_returned_across_keys() -> None:
    pool = ActivationPool(budgets={"cpu": 3 * KIB})
    a, b, c = (pool.rent((256,), dtype, "cpu") for dtype in (F32, torch.int32, F32))  # a, c: one key
    d = pool.rent((16, 16), F32, "cpu")  # 1 KiB, a third key
    for tensor in (b, a, c, d):
        pool.give_back(tensor)  # idle 4 KiB > 3: b, the least recently returned, goes
    assert pool.stats()["cpu"].evictions == 1
    pool.rent((128,), torch.float64, "cpu")  # a 1 KiB miss makes room for itself: a goes next
    assert pool.stats()["cpu"].evictions == 2
    assert pool.rent((256,), F32, "cpu") is c and pool.rent((16, 16), F32, "cpu") is d
    assert pool.rent((256,), torch.int32, "cpu") is not b
    assert pool.stats()["cpu"].hits == 2


def test_same_key_reuse_takes_the_warmest_buffer() -> None:
    pool = ActivationPool(budgets={"cpu": 10 * KIB})
    first, second = kib(pool), kib(pool)
    pool.give_back(first)
    pool.give_back(second)
    assert kib(pool) is second and kib(pool) is first
    assert pool.stats()["cpu"].hits == 2 and pool.stats()["cpu"].bytes_idle == 0


def test_warm_buffers_are_found_among_many_idle_keys() -> None:
    pool = ActivationPool()
    warm = pool.rent((7, 7), F32, "cpu")
    pool.give_back(warm)
    for width in range(1, 2001):  # thousands of idle buffers of other keys, returned after it
        pool.give_back(pool.rent((width,), torch.int8, "cpu"))
    assert pool.rent((7, 7), F32, "cpu") is warm
    assert pool.stats()["cpu"].hits == 1 and pool.stats()["cpu"].misses == 2001


def test_many_distinct_shapes_keep_idle_bytes_within_the_budget() -> None:
    budget = 64 * KIB
    pool = ActivationPool(budgets={"cpu": budget})
    for width in range(64, 264):  # 200 distinct request widths
        with pool.scope() as scope:
            scope.rent((2, 4, 8, width), F32, "cpu")
            scope.rent((1, 3, 8, width), F32, "cpu")
        assert pool.stats()["cpu"].bytes_idle <= budget
    stats = pool.stats()["cpu"]
    assert stats.misses == 400 and stats.bytes_in_use == 0
    assert stats.evictions > 300 and stats.bytes_pooled == stats.bytes_idle <= budget


def test_a_zero_budget_keeps_nothing_idle() -> None:
    pool = ActivationPool(budgets={"cpu": 0})
    for _ in range(3):
        request(pool)
    stats = pool.stats()["cpu"]
    assert stats.bytes_idle == 0 and stats.hits == 0 and stats.evictions == 3 * len(SHAPES)


def test_an_outsized_buffer_does_not_flush_the_warm_ones() -> None:
    pool = ActivationPool(budgets={"cpu": 4 * KIB})
    small = kib(pool)
    pool.give_back(small)
    big = kib(pool, 8)  # alone over the budget: evicts nothing to make room
    pool.give_back(big)  # and is dropped on return
    stats = pool.stats()["cpu"]
    assert stats.evictions == 1 and stats.bytes_idle == KIB
    assert kib(pool) is small


def test_the_star_budget_applies_to_devices_not_named() -> None:
    pool = ActivationPool(budgets={"*": 0, "meta": 8 * KIB})
    for device in ("cpu", "meta"):
        pool.give_back(pool.rent((256,), F32, device))
    assert pool.budget("cpu") == 0 and pool.budget("meta") == 8 * KIB
    assert pool.stats()["cpu"].bytes_idle == 0 and pool.stats()["meta"].bytes_idle == KIB
    assert ActivationPool().budget("cpu") is None


def test_trim_drops_only_buffers_idle_longer_than_asked() -> None:
    clock = FakeClock()
    pool = ActivationPool(clock=clock)
    old, newer = kib(pool), kib(pool, 2)
    pool.give_back(old)
    clock.now += 50
    pool.give_back(newer)
    clock.now += 20  # old: idle 70 s, newer: 20 s
    assert pool.trim(idle_for_s=60) == KIB
    assert pool.trim(idle_for_s=60) == 0
    stats = pool.stats()["cpu"]
    assert stats.evictions == 1 and stats.bytes_idle == 2 * KIB
    assert kib(pool, 2) is newer
    pool.give_back(newer)  # returned again: its idle time starts over
    clock.now += 30
    assert pool.trim(idle_for_s=30) == 0 and pool.trim(idle_for_s=29) == 2 * KIB
    assert pool.stats()["cpu"].bytes_pooled == 0


def test_default_budgets_are_shares_of_host_memory() -> None:
    total = host_memory()[1]
    assert default_pool_budgets(["cpu"]) == {"cpu": int(0.05 * total)}
    assert default_pool_budgets([]) == {"cpu": int(0.05 * total)}  # pinned host buffers count there


def test_concurrent_renters_never_share_a_buffer() -> None:
    pool = ActivationPool()
    start = threading.Barrier(8)
    errors: list[str] = []

    def worker(mark: float) -> None:
        start.wait(timeout=10)
        for _ in range(200):
            with pool.scope() as scope:
                t = scope.rent((64,), F32, "cpu")
                t.fill_(mark)
                if not bool((t == mark).all()):  # another holder wrote into it
                    errors.append(f"buffer shared while worker {mark} held it")

    threads = [threading.Thread(target=worker, args=(float(i),)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    stats = pool.stats()["cpu"]
    assert stats.bytes_in_use == 0 and stats.hits + stats.misses == 8 * 200
    assert stats.misses <= 8  # never more buffers than concurrent holders


def test_clear_drops_idle_buffers() -> None:
    pool = ActivationPool()
    request(pool)
    pool.clear()
    stats = pool.stats()["cpu"]
    assert stats.bytes_pooled == stats.bytes_idle == 0 and stats.evictions == len(SHAPES)
