"""Metrics on a fresh registry equal the live state they describe, after real generations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from server.metrics import CATALOG, Metrics, metric_name
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.serving import Runtime, Service

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def served(folders: dict[str, Path]):
    """A runtime whose service ran real generations, and the metrics registry reading it."""
    pipeline = Pipeline.load(folders["sd15"], devices="cpu,cpu", strategy="even")
    runtime = Runtime("tiny-sd15", "float32", queue_capacity=7)
    runtime.service, runtime.load_seconds = Service(pipeline, "tiny-sd15", max_queue=7, max_batch=8), 1.5
    registry = CollectorRegistry()
    metrics = Metrics(registry, runtime.snapshot)
    jobs = [
        runtime.service.submit([GenerationRequest("a red circle", seed=s, steps=3) for s in range(n)])
        for n in (1, 2)
    ]
    for job in jobs:
        job.future.result(timeout=60)
    yield runtime, registry, metrics
    runtime.service.close()


def test_values_equal_the_pool_shard_and_engine_state(served) -> None:
    runtime, registry, _ = served
    value = registry.get_sample_value
    pipeline, stats = runtime.service.pipeline, runtime.service.stats()

    for device, pool in pipeline.pool.stats().items():
        assert value("diffshard_pool_pooled_bytes", {"device": device}) == pool.bytes_pooled > 0
        assert value("diffshard_pool_in_use_bytes", {"device": device}) == pool.bytes_in_use == 0
        assert value("diffshard_pool_rents_total", {"device": device, "result": "hit"}) == pool.hits
        assert value("diffshard_pool_rents_total", {"device": device, "result": "miss"}) == pool.misses
    shard = pipeline.shard
    labels = {"device": "cpu", "gpu": "", "UUID": ""}
    assert value("diffshard_shard_parameter_bytes", labels) == shard.param_bytes()["cpu"]
    assert value("diffshard_shard_blocks", labels) == len(shard.plan.blocks)  # both stages on cpu
    assert 0 < value("diffshard_device_free_bytes", labels) <= value("diffshard_device_total_bytes", labels)
    assert value("diffshard_process_resident_bytes") > shard.param_bytes()["cpu"]

    assert value("diffshard_images_generated_total") == stats.images_completed == 3
    assert value("diffshard_step_duration_seconds_count") == stats.steps > 0
    assert value("diffshard_batch_rows_sum") == stats.rows_total
    assert value("diffshard_batch_rows_count") == stats.steps
    assert value("diffshard_queue_wait_seconds_count") == 2
    assert value("diffshard_queue_depth") == 0 and value("diffshard_queue_capacity") == 7
    assert value("diffshard_running_requests") == 0
    assert value("diffshard_rejections_total", {"reason": "queue_full"}) == 0
    assert value("diffshard_model_load_duration_seconds") == 1.5


def test_rejections_join_engine_and_http_reasons(served) -> None:
    runtime, registry, _ = served
    service = runtime.service
    service.drain(timeout_s=0)
    with pytest.raises(Exception, match="shutting down"):
        service.submit([GenerationRequest("a red circle", steps=2)])
    runtime.http_rejected["unauthorized"] += 2  # as HttpMetrics counts a 401
    value = registry.get_sample_value
    assert value("diffshard_rejections_total", {"reason": "draining"}) == 1
    assert value("diffshard_rejections_total", {"reason": "unauthorized"}) == 2
    assert value("diffshard_rejections_total", {"reason": "timeout"}) == 0


def test_every_family_is_named_by_convention_and_documented(served) -> None:
    _, registry, _ = served
    exposition = generate_latest(registry).decode()
    docs = (ROOT / "docs" / "metrics.md").read_text()
    for family in CATALOG:
        name = metric_name(family)
        assert name.startswith("diffshard_") and re.fullmatch(r"[a-z_]+", name)
        assert f"| `{name}` | {family.type} |" in docs, f"{name} is missing from docs/metrics.md"
        served_adapters = family.labels == ("adapter",)  # a series per adapter: none loaded here (test_lora)
        if (
            not family.cuda_only
            and not served_adapters
            and not family.name.startswith("video_")  # a video model's (tests/test_videos.py)
            and family.name
            not in (
                "http_requests_total",
                "http_request_duration_seconds",
            )
        ):
            assert f"\n{name}" in exposition, f"{name} is not exported"


@pytest.mark.gpu
def test_cuda_values_equal_the_allocator(folders: dict[str, Path]) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cuda:0,cpu", strategy="even")
    runtime = Runtime("tiny-sd15", "float32", queue_capacity=64)
    runtime.service = Service(pipeline, "tiny-sd15")
    registry = CollectorRegistry()
    Metrics(registry, runtime.snapshot)
    try:
        runtime.service.submit([GenerationRequest("a red circle", steps=3)]).future.result(timeout=60)
        torch.cuda.synchronize()
        index = torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        labels = {
            "device": "cuda:0",
            "gpu": str(index),
            "UUID": uuid if uuid.startswith("GPU-") else f"GPU-{uuid}",
        }
        value = registry.get_sample_value
        assert value("diffshard_device_allocated_bytes", labels) == torch.cuda.memory_allocated(0)
        assert value("diffshard_device_reserved_bytes", labels) == torch.cuda.memory_reserved(0)
        assert value("diffshard_device_total_bytes", labels) == torch.cuda.mem_get_info(0)[1]
        assert value("diffshard_shard_parameter_bytes", labels) == pipeline.shard.param_bytes()["cuda:0"]
    finally:
        runtime.service.close()
