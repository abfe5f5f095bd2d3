"""A pipeline's compiled graphs made ready before it serves: every shape bucket (an image size ×
a row count) from a real request's inputs, so the graphs are exactly what the step loop calls.

    stats = compile_pipeline(pipeline, CompileMode.BLOCKS, sizes=[64], max_rows=16, cache_dir=...)
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils._pytree import tree_map

from server.engine import CallPlan, ModelShard, layout_of
from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.hardware.devices import wait_for_queued
from server.engine.hardware.threads import intra_op_threads
from server.engine.runtime.compile import (
    CompiledDecoder,
    CompileMode,
    decodes_in_tiles,
    row_buckets,
    run_decoder,
)
from server.engine.runtime.graphs import CompileRoute, CompileStats, GraphStore
from server.engine.runtime.packages import KEPT_BYTES
from server.engine.runtime.pool import ActivationPool
from server.engine.runtime.tracing import CompileStopped, GiveWay, compiling_on_this_thread, trace_gate
from server.pipeline.pipeline import Pipeline
from server.pipeline.steps.caching import hold
from server.pipeline.steps.state import RequestState
from server.requests.generation import GenerationRequest

log = logging.getLogger("diffshard")

TIMED_CALLS = 3  # each way, per bucket: whether its graphs are kept
BACKGROUND_NICE = 10  # a background compile yields the cores to the step loop's calls
# ... but not the interpreter: tracing holds the GIL, and the step loop, taking it back after
# each operator, waited up to the 5 ms default each time (a first request during a cold compile
# took 24 s against 0.6 s): a shorter interval while it compiles
SWITCH_WHILE_COMPILING = 0.0005
CLEAR_MARGIN = 0.9  # a verdict is taken again only where one way took at most this of the other's time
AGREEING = 2  # ... or where a close verdict came out the same way at this many starts in a row
KEPT_VERDICTS = 4096  # in a cache directory, the most recent


class Verdicts:
    """`--compile auto`'s timings of each bucket, compiled against eager, kept in the cache
    directory (`compiled/verdicts.json`) so a warm restart that loads its graphs need not time
    them again (an SD-1.5-width UNet's 256² buckets: 13 s of a 31 s restart, on 2 cores). A
    verdict is taken again where it was clear (one way at most `CLEAR_MARGIN` of the other's
    time) or where a close one came out the same way at `AGREEING` starts in a row (the
    SD-1.5-width VAE's decode, 0.95x eager: 12 s of timing a restart): a busy host's noise never
    decides for good. A verdict is keyed by its graphs (the model's config and its weights'
    kinds, the inputs' shapes, whether frozen) and by what every graph's key holds (torch, the
    device kind, the threads, the traced code: a release whose eager calls differ times again)."""

    def __init__(self, store: GraphStore) -> None:
        self.store = store
        self.path = None if store.folder is None else store.folder / "compiled" / "verdicts.json"
        self.waiting: list[Callable[[], None]] = []  # close ones of earlier starts, timed once ready
        self._known: dict[str, dict[str, float]] = {}
        if self.path is not None and self.path.is_file():
            try:
                self._known = dict(json.loads(self.path.read_text()))
            except (OSError, ValueError, TypeError) as err:  # damaged: timed again, written anew
                log.warning("compile verdicts %s are unusable (%s): buckets are timed again", self.path, err)

    def key(self, model: torch.nn.Module, what: str, graphs: object, frozen: bool) -> str:
        config = getattr(model, "config", None)
        # quantized weights (`--quantize`) time otherwise under the same config
        weights = sorted({f"{type(p).__name__} {p.dtype}" for p in model.parameters()})
        described = {"verdict": what, "class": type(model).__name__, "config": config, "weights": weights}
        return self.store.key({**described, "graphs": repr(graphs), "frozen": frozen})

    def settled(self, key: str) -> dict[str, float] | None:
        """The timing recorded for `key`, where its verdict is settled: clear, or agreed on."""
        if (known := self.recorded(key)) is None:
            return None
        faster, slower = sorted((known.get("compiled_ms", 0.0), known.get("eager_ms", 0.0)))
        clear = 0 < faster <= CLEAR_MARGIN * slower
        return known if clear or known.get("agreeing", 1) >= AGREEING else None

    def recorded(self, key: str) -> dict[str, float] | None:
        """The timing recorded for `key` at an earlier start, settled or not."""
        known = self._known.get(key)
        return known if isinstance(known, dict) else None

    def record(self, key: str, timing: dict[str, float]) -> None:
        """`timing` (compiled_ms, eager_ms) timed now for `key`; counted as agreeing with the
        verdict before it where it came out the same way."""
        before, kept = self._known.get(key), timing["compiled_ms"] < timing["eager_ms"]
        same = isinstance(before, dict) and (before.get("compiled_ms", 0) < before.get("eager_ms", 0)) == kept
        agreeing = before.get("agreeing", 1) + 1 if same else 1
        self._known[key] = {**timing, "agreeing": agreeing, "at": round(time.time())}
        if self.path is None:
            return
        newest = sorted(self._known.items(), key=lambda item: item[1].get("at", 0))[-KEPT_VERDICTS:]
        self._known = dict(newest)
        try:
            written = self.path.with_name(f".verdicts-{os.getpid()}.tmp")
            written.write_text(json.dumps(self._known))
            written.replace(self.path)  # whole: a start reading it meanwhile sees the old or the new
        except OSError as err:
            log.warning("cannot keep compile verdicts in %s (%s): buckets are timed again", self.path, err)


def compile_pipeline(
    pipeline: Pipeline,
    mode: CompileMode,
    sizes: Sequence[int],
    max_rows: int,
    cache_dir: Path | None,
    stats: CompileStats | None = None,
    on_progress: Callable[[CompileStats], None] | None = None,
    background: bool = False,
    budget_s: float | None = None,
    give_way: GiveWay | None = None,
    route: CompileRoute | str = CompileRoute.AUTO,
    kept_bytes: int = KEPT_BYTES,
) -> CompileStats:
    """Compile (or load from `cache_dir`) the denoiser for every image side in `sizes` at every
    row bucket up to `max_rows`, and the VAE's decoder for up to half as many images (at the sizes
    it decodes whole: tiles run eagerly).

    `background`: return once what can be refused is checked, and compile on a thread of its own
    at a lower priority while the pipeline serves: a call runs eagerly until its bucket's graphs
    are ready, then through them (no request waits on a compile); `stats.done` is set at the end,
    `stats.state` says how it ended (a failure is logged: the graphs ready by then stay in use,
    every other call runs eagerly). `give_way`: the service says there when its step loops have
    work, and a background compile pauses meanwhile.

    `budget_s`: once a bucket ends past it, no other is begun (`stats.state` "stopped"): the
    buckets not built run eagerly. Buckets are taken most useful first (a lone image's at each
    size), and the first is always built. `route`: `--compile-route` (`graphs.py`); `kept_bytes`:
    frozen graphs' libraries kept in `cache_dir` (`packages.py`).

    Adapters may be attached before or during it: their hooks add nothing while a graph is
    traced (`conditioning/adapters.py`), and rows with adapters run eagerly."""
    stats = stats or CompileStats(str(mode))
    measured = mode == CompileMode.AUTO
    if measured:
        mode, why = auto_mode(pipeline)
        stats.mode = f"auto: {mode}"
        log.info("--compile auto: %s (%s)", mode, why)
    if mode == CompileMode.OFF:
        stats.finish("off")
        return stats
    # keyed by every device compiled code runs on: each replica's stages, and the VAE's decoder
    devices = [*(d for shard in pipeline.replicas for d in shard.devices), pipeline.encoder_device]
    give_way = give_way or GiveWay()  # never told of work: never pauses
    # a library building in its own process is waited for as a compile gives way: stopped with it
    store = GraphStore(cache_dir, devices, stats, pipeline.lane_threads, route, kept_bytes, give_way.wait)
    # each its own, every expert's too; replicas (and experts: the module is an argument) share the graphs
    shards = [shard for deployment in pipeline.experts for shard in deployment.replicas]
    for shard in shards:
        shard.compile(mode, store)  # refusals raise here, before anything is compiled
    # set now: lanes copy the pipeline when the service starts; it decodes eagerly until ready
    pipeline.decoder = decoder = CompiledDecoder(pipeline.vae, store)
    verdicts = Verdicts(store) if measured else None
    warm = partial(_warm, pipeline, mode, sizes, max_rows, decoder, shards, on_progress, verdicts, budget_s)
    warm = partial(_as_lanes, pipeline.lane_threads, warm, give_way)
    settle = partial(_as_lanes, pipeline.lane_threads, _time_waiting, verdicts)
    trace_gate()  # from now on a trace waits for the step loop's calls in flight, and they for it

    def build() -> None:
        state = warm()
        store.keep_artifacts()
        stats.finish(state)  # every graph ready: calls run through them from now on
        settle()

    if not background:
        build()
        return stats

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread's nice value alone
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        switch, state = sys.getswitchinterval(), "failed"
        sys.setswitchinterval(SWITCH_WHILE_COMPILING)
        try:
            with give_way.paused_while_serving():
                build()
        except CompileStopped:
            state = "stopped"
            log.info("compile stopped: the server is shutting down")
        except Exception:
            log.exception("compile failed: calls its graphs do not hold yet keep running eagerly")
        finally:
            sys.setswitchinterval(switch)
        if not stats.done.is_set():  # it ended before its graphs were ready
            stats.finish(state)

    stats.state = "compiling"
    threading.Thread(target=run, name="compile", daemon=True).start()
    log.info("compiling %s in the background: calls run eagerly until their graphs are ready", mode)
    return stats


def auto_mode(pipeline: Pipeline) -> tuple[CompileMode, str]:
    """What `--compile auto` compiles here, and why: one graph a call where every replica is one
    CPU stage that traces whole, else each block; nothing where this PyTorch cannot, or for tensor
    and sequence groups (their ranks exchange between blocks, inside a call). On GPUs each block:
    a DiT's repeated blocks share one graph, compiled once (FLUX.1-dev's 57 blocks: 15 s to its
    first call, 0.77x eager, on an H200), where one graph a call traces and compiles every block's
    code again; the CPU's gain of a whole graph, weights folded in (`frozen.py`), is the CPU's."""
    on_cpu = any(d == "cpu" for s in pipeline.replicas for d in s.devices)
    if on_cpu and not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++")):
        return CompileMode.OFF, "no C++ compiler for inductor's CPU kernels: install g++ to compile"
    deployment = pipeline.deployment
    if deployment.tensor > 1 or deployment.sequence > 1 or deployment.grouped:
        return CompileMode.OFF, "tensor and sequence groups run eagerly"
    if any(len(s.plan.stages) > 1 for s in pipeline.replicas):
        return CompileMode.BLOCKS, "the plan splits the model into stages: each block a graph"
    if not on_cpu:
        return CompileMode.BLOCKS, "on GPUs each block kind's graph is compiled once, for all its blocks"
    return CompileMode.FULL, "one stage per replica: one graph a call"


def _as_lanes(threads: int | None, fn: Callable[..., str], *args: Any) -> str:
    """`fn(*args)` on a thread marked as compiling (`compiling_here`), with its intra-op threads
    those of a lane (`threads`; None: the process's). Inductor writes the count it sees into its
    CPU kernels (`#pragma omp parallel num_threads`), and times measured here must be a lane's:
    graphs built with the process's 2 threads, run by 2 replicas of 1 thread side by side (a lone
    512² image's rows split), took 2.9 s a step against the 1.34 s their bucket was timed at."""
    with intra_op_threads(threads), compiling_on_this_thread():
        return fn(*args)


def _warm(
    pipeline: Pipeline,
    mode: CompileMode,
    sizes: Sequence[int],
    max_rows: int,
    decoder: CompiledDecoder,
    shards: list,
    on_progress: Callable[[CompileStats], None] | None,
    verdicts: Verdicts | None,
    budget_s: float | None,
    give_way: GiveWay,
) -> str:
    """Every bucket's graphs, from a real request's inputs (`compile_pipeline`); with `verdicts`
    (`--compile auto`), each bucket's kept only where its calls were faster than eager ones, a
    close verdict of an earlier start's taken for now (`Verdicts.waiting`). Says how it ended:
    "ready", or "stopped" where `budget_s` ran out first."""
    stats, started = decoder.store.stats, time.perf_counter()
    # The warm-up requests' tensors live as long as the compile (minutes): rented from the
    # service's pool they would read as its rented bytes all along, over its idle budget.
    pipeline = copy.copy(pipeline)
    pipeline.pool = ActivationPool()
    # A guided request is 2 rows; split over idle replicas, each gets 1 (padding it to 2 would
    # double their work).
    rows = row_buckets(max_rows, smallest=1 if pipeline.splits_lone else min(2, max_rows))
    images = row_buckets(max(1, max_rows // 2), smallest=1)
    # a block with nothing to do for a text prompt (`BlockCall.needs`: FLUX.3's references') is not warmed
    calls = shards[0].calls
    blocks = [b for b in layout_of(shards[0].model).blocks if calls[b.name].needs is None]
    per_bucket = 1 if mode == CompileMode.FULL else len(blocks)
    whole = [s for s in sizes if not decodes_in_tiles(pipeline.vae, pipeline.family.latent_shape(s, s))]
    stats.graphs_total = len(sizes) * len(shards) * len(rows) * per_bucket + len(whole) * len(images)
    states = {}  # each size's warm-up request, resolved

    def denoiser(size: int, count: int) -> None:
        with pipeline.pool.scope() as batch, torch.inference_mode():
            inputs = _rows_of(pipeline.stacked([states[size]], batch), count)
            frozen = stats.frozen
            added = [(shard, shard.warm(inputs, count)) for shard in shards]
            if verdicts is not None:
                froze = stats.frozen > frozen
                _keep_if_faster(stats, added, inputs, size, count, give_way, verdicts, froze)
        _said(stats, f"{size}px × {count} rows", started, on_progress)

    def decoding(size: int, count: int) -> None:  # tiled sizes decode eagerly (CompiledDecoder)
        latents = pipeline.family.unscale_latents(
            states[size].latents.to(pipeline.encoder_device, pipeline.vae.dtype)
        )
        batch_latents = latents.expand(count, *latents.shape[1:]).contiguous()
        frozen = stats.frozen
        key = decoder.warm(batch_latents)
        if verdicts is not None:
            froze = stats.frozen > frozen
            _keep_decoder_if_faster(stats, decoder, batch_latents, key, size, give_way, verdicts, froze)
        _said(stats, f"decoder {size}px × {count}", started, on_progress)

    # a lone image's bucket at every size first: it is the first to freeze (`freeze_budget`)
    buckets = [partial(denoiser, s, rows[0]) for s in sizes]
    buckets += [partial(denoiser, s, r) for s in sizes for r in rows[1:]]
    buckets += [partial(decoding, s, n) for s in whole for n in images]
    ended = "ready"
    try:
        for size in sizes:
            frame = Image.new("RGB", (size, size)) if pipeline.family.takes_reference else None  # i2v
            warm = GenerationRequest("warm", width=size, height=size, reference=frame)
            (states[size],) = pipeline.start([pipeline.resolve(pipeline.with_defaults(warm))])
            if hasattr(shards[0].spec, "held"):
                _hold_first_call(pipeline, states[size])
        for built, bucket in enumerate(buckets):
            if built and budget_s is not None and time.perf_counter() - started > budget_s:
                log.warning(
                    "compile stopped at its budget (--compile-budget-s %g): %d of %d buckets built, "
                    "the others' calls run eagerly",
                    budget_s,
                    built,
                    len(buckets),
                )
                ended = "stopped"
                break
            bucket()
    finally:
        for state in states.values():
            state.close()
    log.info(
        "compiled (%s): %d graphs in %.1f s, %d loaded from the cache, %d compiled",
        mode,
        stats.graphs_ready,
        stats.seconds,
        stats.loaded,
        stats.compiled,
    )
    return ended


def _keep_if_faster(
    stats: CompileStats,
    added: list[tuple[ModelShard, list]],
    inputs: DenoiserInputs,
    size: int,
    rows: int,
    give_way: GiveWay,
    verdicts: Verdicts,
    frozen: bool,
) -> None:
    """`--compile auto`: time a bucket's call through its graphs against eagerly (on the first
    shard: the others hold the same graphs), and stop using the graphs where they were not faster
    (a tiny model's calls may be quicker than a graph's overhead; a large UNet's convolutions are
    oneDNN's either way)."""
    shard = added[0][0]
    measured = replace(CallPlan.plain(rows), counted=False)  # the service's call counts are its own
    plans = {True: measured, False: replace(measured, compiled=False)}
    inputs = _owned(inputs)  # timed again later, perhaps: not the warm-up pool's, rented again
    runs = {graphs: partial(shard.run, inputs, plan) for graphs, plan in plans.items()}
    what = f"{size}px × {rows} rows"
    key = verdicts.key(shard.model, what, added[0][1], frozen)

    def drop() -> None:
        for each, keys in added:
            assert each.compiled is not None
            each.compiled.drop(keys)

    _faster(stats, runs, shard.devices, what, give_way, verdicts, key, drop)


def _keep_decoder_if_faster(
    stats: CompileStats,
    decoder: CompiledDecoder,
    latents: torch.Tensor,
    key: tuple | None,
    size: int,
    give_way: GiveWay,
    verdicts: Verdicts,
    frozen: bool,
) -> None:
    """The same for a batch size's decoder graph."""
    if key is None:
        return
    runs = {True: partial(decoder, latents), False: partial(run_decoder, decoder.vae, latents)}
    what = f"decoder {size}px × {latents.shape[0]}"
    recorded = verdicts.key(decoder.vae, what, key, frozen)
    drop = partial(decoder.drop, key)
    _faster(stats, runs, [str(latents.device)], what, give_way, verdicts, recorded, drop)


def _faster(
    stats: CompileStats,
    runs: dict[bool, Callable[[], object]],
    devices: Sequence[str],
    what: str,
    give_way: GiveWay,
    verdicts: Verdicts,
    key: str,
    drop: Callable[[], None],
) -> None:
    """Keep the graphs where `runs[True]` (graphs) take less than `runs[False]` (eager), else
    `drop` them: as a settled verdict recorded at earlier starts says (`Verdicts`), else timed now
    (`_timed`) and recorded; in `stats.buckets` and said in the log. A close verdict of an earlier
    start keeps the graphs for now and waits to be timed again once every graph is ready:
    timed at a restart, it held the graphs' readiness back (an SD-1.5-width VAE's 512² decode: 8
    calls of 7 s on 2 cores) for a difference of a tenth at most."""
    entry: dict[str, Any] = {"bucket": what}
    stats.buckets.append(entry)
    if (timing := verdicts.settled(key)) is not None:
        _judged(entry, timing, drop, timed=False, when="as timed at an earlier start")
    elif (close := verdicts.recorded(key)) is not None:
        entry.update(compiled_ms=close["compiled_ms"], eager_ms=close["eager_ms"], kept=True, timed=False)
        log.info(
            "compile: %s compiled for now (%.1f ms compiled, %.1f ms eager at an earlier start: "
            "close, timed again once every graph is ready)",
            what,
            close["compiled_ms"],
            close["eager_ms"],
        )
        verdicts.waiting.append(partial(_time_now, entry, runs, devices, give_way, verdicts, key, drop))
    else:
        _time_now(entry, runs, devices, give_way, verdicts, key, drop)


def _time_now(
    entry: dict[str, Any],
    runs: dict[bool, Callable[[], object]],
    devices: Sequence[str],
    give_way: GiveWay,
    verdicts: Verdicts,
    key: str,
    drop: Callable[[], None],
) -> None:
    """Time a bucket's calls both ways now, record the timing, and judge it (`_judged`)."""
    compiled_s, eager_s = _timed(runs, devices, give_way)
    timing = {"compiled_ms": round(compiled_s * 1e3, 2), "eager_ms": round(eager_s * 1e3, 2)}
    verdicts.record(key, timing)
    _judged(entry, timing, drop, timed=True)


def _judged(
    entry: dict[str, Any], timing: dict[str, float], drop: Callable[[], None], timed: bool, when: str = ""
) -> None:
    """`entry` (in `stats.buckets`) by `timing`, said in the log; the graphs dropped where they
    were not faster."""
    compiled_ms, eager_ms = timing["compiled_ms"], timing["eager_ms"]
    kept = compiled_ms < eager_ms
    if not kept:
        drop()
    entry.update(compiled_ms=compiled_ms, eager_ms=eager_ms, kept=kept, timed=timed)
    verdict = "compiled" if kept else "kept eager: its graphs were not faster"
    when = f", {when}" if when else ""
    log.info(
        "compile: %s %s (%.1f ms compiled, %.1f ms eager%s)",
        entry["bucket"],
        verdict,
        compiled_ms,
        eager_ms,
        when,
    )


def _time_waiting(verdicts: Verdicts | None) -> None:
    """The close verdicts taken for now (`_faster`), timed again."""
    while verdicts is not None and verdicts.waiting:
        verdicts.waiting.pop(0)()


def _timed(
    runs: dict[bool, Callable[[], object]], devices: Sequence[str], give_way: GiveWay
) -> tuple[float, float]:
    """Seconds a call of `runs[True]` and of `runs[False]` took: medians of TIMED_CALLS each, in
    turn, after one of each. A call paused for the step loops' work (`give_way`) is timed again."""
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for turn in range(1 + TIMED_CALLS):
            for graphs, run in runs.items():
                pauses = -1
                while pauses != give_way.pauses:
                    give_way.wait()
                    pauses, started = give_way.pauses, time.perf_counter()
                    run()
                    wait_for_queued(devices)  # this thread's work: the lanes' runs on
                if turn:
                    times[graphs].append(time.perf_counter() - started)
    return statistics.median(times[True]), statistics.median(times[False])


def _hold_first_call(pipeline: Pipeline, state: RequestState) -> None:
    """A denoiser whose rows keep what their first call made (Qwen-Image 2.1's prefix keys and
    values) warms from the calls that repeat, on what they keep: the first call runs (uncounted)."""
    with pipeline.pool.scope() as batch, torch.inference_mode():
        plan = replace(pipeline.call_plan([state]), counted=False)
        hold(state, pipeline.forward(pipeline.stacked([state], batch), plan).outcomes[0])


def _owned(inputs: DenoiserInputs) -> DenoiserInputs:
    """`inputs` with tensors of their own."""
    own = lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf  # noqa: E731
    return DenoiserInputs(*(tree_map(own, value) for value in vars(inputs).values()))


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
