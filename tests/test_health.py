"""What the step loop's health sees, unit by unit: which errors are out-of-memory, which leave a
device broken, and how the heartbeat counts (the loop and HTTP-level behaviour is in
tests/test_loop.py and tests/reliability/test_edges.py)."""

from __future__ import annotations

import pytest
import torch

from server.serving.health import Heartbeat, is_out_of_memory, is_sticky


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
    heartbeat.begin()
    now[0] += 7.5
    assert heartbeat.running_for() == 7.5
    heartbeat.end()
    assert heartbeat.running_for() == 0.0 and heartbeat.last_beat is not None
