"""What the step loop's health sees, unit by unit: which errors are out-of-memory, which leave a
device broken, and how the heartbeat counts (the loop and HTTP-level behaviour is in
tests/test_loop.py and tests/reliability/test_edges.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from server.requests import GenerationRequest
from server.serving.calls import WatchedCalls
from server.serving.health import STUCK_AFTER, Heartbeat, Watchdog, is_out_of_memory, is_sticky


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: out of memory"
        ),
    ],
)
def test_allocation_failures_of_every_library_count_as_out_of_memory(error: Exception) -> None:
    assert is_out_of_memory(error) and not is_sticky(error)


def test_a_sticky_device_error_marks_the_heartbeat_broken_and_an_ordinary_one_does_not() -> None:
    heartbeat = Heartbeat()
    heartbeat.failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert heartbeat.broken is None and heartbeat.failures_in_a_row == 1
    heartbeat.failed(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert heartbeat.broken is not None and heartbeat.failures_in_a_row == 2
    heartbeat.succeeded()
    assert heartbeat.failures_in_a_row == 0 and heartbeat.broken is not None  # it does not clear


def test_out_of_memory_does_not_count_towards_unreadiness() -> None:
    heartbeat = Heartbeat()
    for _ in range(5):
        heartbeat.failed(torch.OutOfMemoryError("out of memory"))
    assert heartbeat.failures_in_a_row == 0


def test_the_heartbeat_times_the_call_in_flight_with_its_clock() -> None:
    now = [100.0]
    heartbeat = Heartbeat(clock=lambda: now[0])
    assert heartbeat.running_for() == 0.0
    heartbeat.begin(deadline_s=10.0)
    now[0] += 7.5
    assert heartbeat.running_for() == 7.5 and heartbeat.overdue() is None
    now[0] += 5.0
    assert heartbeat.overdue() == (1, 12.5, 10.0)  # the first call, 12.5 s run, its deadline 10 s
    heartbeat.end()
    assert heartbeat.running_for() == 0.0 and heartbeat.last_beat is not None
    assert heartbeat.overdue() is None


def test_the_watchdog_says_slow_past_the_deadline_and_stuck_far_past_it_once_per_call() -> None:
    now = [0.0]
    heartbeat = Heartbeat(clock=lambda: now[0])
    said: list[tuple[str, float]] = []
    heard, stop = threading.Event(), threading.Event()

    def hear(kind: str):
        def record(running_s: float, deadline_s: float) -> None:
            said.append((kind, running_s))
            heard.set()

        return record

    Watchdog(heartbeat, 0.01, hear("slow"), hear("stuck"), stop).start()
    try:
        heartbeat.begin(deadline_s=2.0)
        for at, kind in [(3.0, "slow"), (2.0 * STUCK_AFTER + 1, "stuck")]:
            now[0] = at
            assert heard.wait(timeout=10), f"the watchdog never said {kind}"
            heard.clear()
            assert said[-1] == (kind, at)
        heartbeat.end()
        heartbeat.begin(deadline_s=2.0)  # the next call: slow again, said again
        now[0] += 3.0
        assert heard.wait(timeout=10)
        assert [kind for kind, _ in said] == ["slow", "stuck", "slow"]
    finally:
        stop.set()


def test_a_call_s_deadline_grows_with_its_rows_and_pixels_beyond_a_full_native_batch() -> None:
    closed = threading.Event()  # ends its watchdog
    calls = WatchedCalls(
        None,  # type: ignore[arg-type]  # deadlines need no pipeline
        step_timeout_s=120.0,
        max_batch=16,
        native_pixels=64 * 64,
        inject_faults=False,
        closed=closed,
        on_stuck=lambda why: None,
    )
    try:
        native = GenerationRequest("a", width=64, height=64)
        big = GenerationRequest("a", width=128, height=128)
        assert calls.deadline_s([native]) == 120.0  # one guided image: well inside a full batch
        assert calls.deadline_s([native] * 8) == 120.0  # 16 rows at the native size: the timeout
        assert calls.deadline_s([big] * 8) == 480.0  # 16 rows at 4x the area: 4x the time
    finally:
        closed.set()
