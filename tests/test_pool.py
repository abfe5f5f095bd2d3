"""ActivationPool: exact keys, scopes that always return, budgets with LRU eviction, threads."""

from __future__ import annotations

import threading

import pytest
import torch

from server.engine.pool import ActivationPool, PoolExhausted

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


def test_budget_holds_and_evicts_least_recently_returned() -> None:
    kib = 1024
    pool = ActivationPool(budgets={"cpu": 3 * kib})
    a, b = pool.rent((256,), F32, "cpu"), pool.rent((256,), F32, "cpu")  # 1 KiB each
    pool.give_back(a)
    pool.give_back(b)
    c = pool.rent((512,), F32, "cpu")  # 2 KiB more: evicts a (returned first), keeps b
    assert pool.stats()["cpu"].evictions == 1 and pool.stats()["cpu"].bytes_pooled == 3 * kib
    assert pool.rent((256,), F32, "cpu") is b
    with pytest.raises(PoolExhausted, match=r"cpu: 1024 more bytes would exceed its budget of 3072"):
        pool.rent((256,), F32, "cpu")
    pool.give_back(c)
    assert pool.stats()["cpu"].bytes_pooled <= 3 * kib


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
    assert stats.bytes_pooled == 0 and stats.evictions == len(SHAPES)
