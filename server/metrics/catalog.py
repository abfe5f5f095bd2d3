"""The catalog of every metric family diffshard exports: name, type, unit, labels and help
(docs/metrics.md is its table; a test keeps the two in step)."""

from __future__ import annotations

from dataclasses import dataclass

from server.serving.outbox import ENDINGS
from server.serving.stats import REASONS

PREFIX = "diffshard"
DEVICE_LABELS = ("device", "gpu", "UUID")  # gpu and UUID as DCGM names them (empty on CPU)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str
    unit: str
    labels: tuple[str, ...]
    help: str
    cuda_only: bool = False


CATALOG = (
    MetricSpec(
        "device_allocated_bytes",
        "gauge",
        "bytes",
        DEVICE_LABELS,
        "bytes in live tensors (allocator)",
        True,
    ),
    MetricSpec(
        "device_reserved_bytes", "gauge", "bytes", DEVICE_LABELS, "bytes the CUDA allocator holds", True
    ),
    MetricSpec(
        "device_peak_allocated_bytes", "gauge", "bytes", DEVICE_LABELS, "highest allocated since start", True
    ),
    MetricSpec(
        "device_free_bytes", "gauge", "bytes", DEVICE_LABELS, "free device memory (on CPU: available RAM)"
    ),
    MetricSpec(
        "device_total_bytes", "gauge", "bytes", DEVICE_LABELS, "device memory (on CPU: the host's RAM)"
    ),
    MetricSpec(
        "shard_parameter_bytes", "gauge", "bytes", DEVICE_LABELS, "weights and buffers the shard placed"
    ),
    MetricSpec(
        "shard_blocks", "gauge", "blocks", DEVICE_LABELS, "denoiser blocks the shard placed on the device"
    ),
    MetricSpec("process_resident_bytes", "gauge", "bytes", (), "the server process's resident memory"),
    MetricSpec("process_peak_resident_bytes", "gauge", "bytes", (), "the process's highest resident memory"),
    MetricSpec(
        "pool_pooled_bytes", "gauge", "bytes", ("device",), "bytes the activation pool holds, idle or rented"
    ),
    MetricSpec("pool_in_use_bytes", "gauge", "bytes", ("device",), "bytes rented out by the activation pool"),
    MetricSpec("pool_rents_total", "counter", "rents", ("device", "result"), "rents by result: hit or miss"),
    MetricSpec(
        "pool_evictions_total", "counter", "buffers", ("device",), "idle buffers evicted for the byte budget"
    ),
    MetricSpec(
        "http_requests_total", "counter", "requests", ("route", "method", "code"), "HTTP requests answered"
    ),
    MetricSpec(
        "http_request_duration_seconds", "histogram", "seconds", ("route",), "time to answer a request"
    ),
    MetricSpec(
        "queue_wait_seconds",
        "histogram",
        "seconds",
        (),
        "arrival to admission (or to leaving the queue)",
    ),
    MetricSpec(
        "step_duration_seconds",
        "histogram",
        "seconds",
        (),
        "one batched denoising step (denoiser + schedulers)",
    ),
    MetricSpec("batch_rows", "histogram", "rows", (), "denoiser rows per batched step (2 per guided image)"),
    MetricSpec(
        "pipeline_call_seconds_total",
        "counter",
        "seconds",
        ("call",),
        "seconds in the step loop's calls into the model, by call: start (prompts encoded, noise drawn), "
        "step (denoising), decode (the VAE)",
    ),
    MetricSpec("queue_depth", "gauge", "requests", (), "requests waiting for a place"),
    MetricSpec("queue_capacity", "gauge", "requests", (), "the queue's bound (DIFFSHARD_MAX_QUEUE)"),
    MetricSpec("running_requests", "gauge", "requests", (), "requests being denoised"),
    MetricSpec("running_rows", "gauge", "rows", (), "denoiser rows of the running requests"),
    MetricSpec(
        "queue_depth_by_priority",
        "gauge",
        "requests",
        ("priority",),
        "requests waiting for a place, by priority class: interactive, background (Batch API lines)",
    ),
    MetricSpec(
        "running_rows_by_priority",
        "gauge",
        "rows",
        ("priority",),
        "denoiser rows of the admitted requests (stepping or parked), by priority class",
    ),
    MetricSpec(
        "rows_stepped_total",
        "counter",
        "rows",
        ("priority",),
        "denoiser rows stepped, by priority class: background rows fill what interactive ones leave",
    ),
    MetricSpec(
        "rejections_total", "counter", "requests", ("reason",), f"requests refused or ended early: {REASONS}"
    ),
    MetricSpec("images_generated_total", "counter", "images", (), "images returned"),
    MetricSpec("video_jobs", "gauge", "jobs", ("state",), "video jobs in the job store, by state"),
    MetricSpec("video_seconds_total", "counter", "seconds", (), "seconds of video this replica made"),
    MetricSpec("video_runs_total", "counter", "runs", (), "video job runs this replica started (reruns too)"),
    MetricSpec(
        "webhook_requests_total",
        "counter",
        "requests",
        ("result",),
        "webhook POSTs this replica sent, by result: acknowledged (a 2xx) or failed",
    ),
    MetricSpec(
        "webhook_events_total",
        "counter",
        "events",
        ("outcome",),
        f"webhook events this replica ended, by outcome: {', '.join(ENDINGS)}",
    ),
    MetricSpec(
        "webhook_pending_events", "gauge", "events", (), "webhook events in the outbox, not yet delivered"
    ),
    MetricSpec(
        "webhook_lag_seconds", "gauge", "seconds", (), "age of the oldest webhook event not yet delivered"
    ),
    MetricSpec(
        "slow_steps_total",
        "counter",
        "calls",
        (),
        "calls past their deadline (the step timeout scaled by their work): /readyz failed meanwhile",
    ),
    MetricSpec(
        "stuck_steps_total",
        "counter",
        "calls",
        (),
        "calls far past their deadline: /livez failed and waiting requests were answered 503",
    ),
    MetricSpec("model_load_duration_seconds", "gauge", "seconds", (), "time to load and place the model"),
    MetricSpec(
        "build",
        "info",
        "",
        ("version", "torch", "diffusers", "model", "dtype", "quantization", "threads", "inject_faults"),
        "versions, the model, torch's threads, and whether fault injection is on",
    ),
    MetricSpec(
        "device_busy_seconds_total",
        "counter",
        "seconds",
        ("device",),
        "seconds a worker (a stage or replica on its device) ran a forward; rate() is its utilisation",
    ),
    MetricSpec(
        "pipeline_bubble_seconds_total",
        "counter",
        "seconds",
        ("device",),
        "seconds a worker sat idle while its model had a forward in flight",
    ),
    MetricSpec("micro_batches_in_flight", "gauge", "micro-batches", (), "forwards running in the shards now"),
    MetricSpec(
        "lora_requests_total", "counter", "requests", ("adapter",), "requests admitted with the LoRA adapter"
    ),
    MetricSpec(
        "lora_rows_total", "counter", "rows", ("adapter",), "denoiser rows stepped with the LoRA adapter"
    ),
    MetricSpec("lora_bytes", "gauge", "bytes", ("device",), "LoRA adapter weights placed on the device"),
    MetricSpec(
        "step_cache_rows_total",
        "counter",
        "rows",
        ("outcome",),
        "denoiser rows of requests with step caching on, by outcome: refreshed (ran every block) or "
        "reused (ran the shallow blocks on kept features)",
    ),
    MetricSpec(
        "step_cache_bytes", "gauge", "bytes", (), "features running requests keep for step caching (pooled)"
    ),
    MetricSpec(
        "images_admitted_total",
        "counter",
        "images",
        ("kind",),
        "images admitted to the step loop, by kind: generation, img2img or inpainting",
    ),
    MetricSpec(
        "denoiser_calls_total",
        "counter",
        "calls",
        ("path",),
        "with --compile on, denoiser calls by path: compiled (a bucket's shape), padded (up to a "
        "bucket) or eager (no bucket holds it, or adapters' rows)",
    ),
    MetricSpec("ready", "gauge", "", (), "1 while /readyz answers 200, else 0"),
    MetricSpec(
        "last_step_timestamp_seconds", "gauge", "seconds", (), "unix time the step loop last finished a call"
    ),
)


def metric_name(family: MetricSpec) -> str:
    return f"{PREFIX}_{family.name}" + ("_info" if family.type == "info" else "")


def help_of(name: str) -> str:
    return next(f.help for f in CATALOG if f.name == name)
