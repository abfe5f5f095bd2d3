"""A pipeline's compiled graphs made ready before it serves: every shape bucket (an image size ×
a row count) from a real request's inputs, so the graphs are exactly what the step loop calls.

    stats = compile_pipeline(pipeline, CompileMode.BLOCKS, sizes=[64], max_rows=16, cache_dir=...)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from PIL import Image
from torch.utils._pytree import tree_map

from server.engine import layout_of
from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.runtime.compile import CompiledDecoder, CompileMode, decodes_in_tiles, row_buckets
from server.engine.runtime.graphs import CompileStats, GraphStore
from server.pipeline.denoise import Pipeline
from server.pipeline.requests import GenerationRequest

log = logging.getLogger("diffshard")

BACKGROUND_NICE = 10  # a background compile yields the cores to the step loop's calls


def compile_pipeline(
    pipeline: Pipeline,
    mode: CompileMode,
    sizes: Sequence[int],
    max_rows: int,
    cache_dir: Path | None,
    stats: CompileStats | None = None,
    on_progress: Callable[[CompileStats], None] | None = None,
    background: bool = False,
) -> CompileStats:
    """Compile (or load from `cache_dir`) the denoiser for every image side in `sizes` at every
    row bucket up to `max_rows`, and the VAE's decoder for up to half as many images (at the sizes
    it decodes whole: tiles run eagerly).

    `background`: return once what can be refused is checked, and compile on a thread of its own
    at a lower priority while the pipeline serves: a call runs eagerly until its bucket's graphs
    are ready, then through them (no request waits on a compile); `stats.done` is set at the end,
    `stats.state` says how it ended (a failure is logged, and every call stays eager).

    Adapters may be attached before or during it: their hooks add nothing while a graph is
    traced (`lora.py`), and rows with adapters run eagerly."""
    stats = stats or CompileStats(str(mode))
    if mode == CompileMode.OFF:
        stats.finish("off")
        return stats
    # keyed by every device compiled code runs on: each replica's stages, and the VAE's decoder
    devices = [*(d for shard in pipeline.replicas for d in shard.devices), pipeline.encoder_device]
    store = GraphStore(cache_dir, devices, stats)
    # each its own, every expert's too; replicas (and experts: the module is an argument) share the graphs
    shards = [shard for deployment in pipeline.experts for shard in deployment.replicas]
    for shard in shards:
        shard.compile(mode, store)  # refusals raise here, before anything is compiled
    warm = partial(_warm, pipeline, mode, sizes, max_rows, store, shards, on_progress)
    if not background:
        warm()
        return stats

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread's nice value alone
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        try:
            warm()
        except Exception:
            log.exception("compile failed: calls keep running eagerly")
            stats.finish("failed")

    stats.state = "compiling"
    threading.Thread(target=run, name="compile", daemon=True).start()
    log.info("compiling %s in the background: calls run eagerly until their graphs are ready", mode)
    return stats


def _warm(
    pipeline: Pipeline,
    mode: CompileMode,
    sizes: Sequence[int],
    max_rows: int,
    store: GraphStore,
    shards: list,
    on_progress: Callable[[CompileStats], None] | None,
) -> None:
    """Every bucket's graphs, from a real request's inputs (`compile_pipeline`)."""
    stats, started = store.stats, time.perf_counter()
    # A guided request is 2 rows; split over idle replicas, each gets 1 (padding it to 2 would
    # double their work).
    rows = row_buckets(max_rows, smallest=1 if pipeline.splits_lone else min(2, max_rows))
    images = row_buckets(max(1, max_rows // 2), smallest=1)
    decoder = CompiledDecoder(pipeline.vae, store)
    per_bucket = 1 if mode == CompileMode.FULL else len(layout_of(shards[0].model).blocks)
    whole = [s for s in sizes if not decodes_in_tiles(pipeline.vae, pipeline.family.latent_shape(s, s))]
    stats.graphs_total = len(sizes) * len(shards) * len(rows) * per_bucket + len(whole) * len(images)
    for size in sizes:
        frame = Image.new("RGB", (size, size)) if pipeline.family.takes_reference else None  # image-to-video
        warm = GenerationRequest("warm", width=size, height=size, reference=frame)
        request = pipeline.resolve(pipeline.with_defaults(warm))
        (state,) = pipeline.start([request])
        try:
            with pipeline.pool.scope() as batch, torch.inference_mode():
                one = pipeline.stacked([state], batch)
                for count in rows:
                    inputs = _rows_of(one, count)
                    for shard in shards:
                        shard.warm(inputs, count)
                    _said(stats, f"{size}px × {count} rows", started, on_progress)
            latents = pipeline.family.unscale_latents(
                state.latents.to(pipeline.encoder_device, pipeline.vae.dtype)
            )
            for count in images if size in whole else ():  # tiled sizes decode eagerly (CompiledDecoder)
                decoder.warm(latents.expand(count, *latents.shape[1:]).contiguous())
                _said(stats, f"decoder {size}px × {count}", started, on_progress)
        finally:
            state.close()
    pipeline.decoder = decoder
    log.info(
        "compiled (%s): %d graphs in %.1f s, %d loaded from the cache, %d compiled",
        mode,
        stats.graphs_ready,
        stats.seconds,
        stats.loaded,
        stats.compiled,
    )
    stats.finish("ready")


def _rows_of(one: DenoiserInputs, count: int) -> DenoiserInputs:
    """`one` request's rows repeated (or cut) to `count` rows."""
    rows = one.sample.shape[0]

    def fit(leaf: object) -> object:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows:
            return leaf.repeat(math.ceil(count / rows), *[1] * (leaf.dim() - 1))[:count]
        return leaf

    return DenoiserInputs(*(tree_map(fit, value) for value in vars(one).values()))


def _said(
    stats: CompileStats, what: str, started: float, on_progress: Callable[[CompileStats], None] | None
) -> None:
    stats.seconds = time.perf_counter() - started
    log.info(
        "compile: %s ready (%d/%d graphs, %.1f s)",
        what,
        stats.graphs_ready,
        stats.graphs_total,
        stats.seconds,
    )
    if on_progress is not None:
        on_progress(stats)
