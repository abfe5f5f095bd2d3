"""The FastAPI application: `create_app(settings, plan)` wires routes, error handlers and metrics;
its lifespan loads the model in a worker thread, so /livez answers and /readyz says 503 while
weights load.

Nothing is built at import time: `python -m server serve` validates the settings and plans the
split on the meta device (a plan that cannot fit fails before any weight loads), then runs this
app under uvicorn, which loads the model with that very plan.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, start_http_server

from server import __version__
from server.api import admin, batches, docs, files, health, playground, routes, videos
from server.api.batches import endpoints as batch_endpoints
from server.api.errors import install_error_handlers
from server.api.hosts import TrustedHosts
from server.api.limits import BodyLimit
from server.api.openapi import Bounds, install_openapi
from server.api.requestid import RequestContext
from server.api.uploads import DATA_URL_PREFIX, bound_decoder
from server.engine import ParallelPlan
from server.engine.hardware.memory import (
    bound_kernel_cache,
    release_freed_host_memory,
    retain_freed_host_memory,
)
from server.engine.hardware.threads import fit_threads
from server.engine.runtime.compile import CompileMode
from server.engine.runtime.graphs import CompileStats, prepare_compiler
from server.engine.runtime.pool import ActivationPool
from server.engine.runtime.tracing import GiveWay
from server.metrics import HttpMetrics, Metrics
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.pipeline.loading.attention_calls import serve_attention
from server.pipeline.loading.folder import Components, quiet_libraries, read_family
from server.pipeline.loading.model_plan import step_knees
from server.pipeline.loading.quantized_parts import describe, float8_speed
from server.pipeline.loading.vae_tiling import VaeTiling
from server.pipeline.loading.warmup import compile_pipeline
from server.requests.control import MAX_CONTROLS
from server.serving import Runtime, Service
from server.serving.batches import BatchRunner, confirm_batch, open_batch_store
from server.serving.outbox import open_outbox
from server.serving.videos import VideoRunner, open_job_store
from server.serving.videostore import shown
from server.serving.webhooks import Webhooks, video_confirm
from server.settings import (
    BatchSettings,
    CompileSettings,
    JobSettings,
    LimitSettings,
    ModelSettings,
    ServerSettings,
    Settings,
    WebhookSettings,
)
from server.settings.values import read_api_keys
from server.settings.webhooks import signing_secret
from server.startup import (
    check_runs_here,
    decide_dtype,
    decoder_for,
    fitted_plan,
    pixel_limit,
    pool_budgets,
    request_defaults,
    request_limits,
    served_dtype,
)

log = logging.getLogger("diffshard")

IDLE_TRIM_S = 60.0  # pooled buffers idle this long go back while the service has nothing to do


def load_service(
    settings: Settings,
    plan: ParallelPlan | None = None,
    compiling: CompileStats | None = None,
    components: Components | None = None,
) -> Service:
    """Load the model placed by `plan` (or by `plan_for` the settings), start compiling it in the
    background (`compiling` shows the progress), and put it behind a step loop. `components`: its
    parts built already (the GPU check's random weights, made on the device), not read from the
    folder, which then gives only the configs, tokenizers and scheduler."""
    check_runs_here(settings)
    retain_freed_host_memory()
    quiet_libraries()
    if settings.compile != CompileMode.OFF:
        prepare_compiler()  # beside planning and loading
    bound_kernel_cache()  # `serve` did already, before planning; an app made in tests does here
    threads = fit_threads(settings.threads)
    family = read_family(settings.model)
    if plan is None:
        settings, plan = fitted_plan(settings, family, folder=settings.model)
    model, limits = ModelSettings.of(settings), LimitSettings.of(settings)
    pool = ActivationPool(pool_budgets(model))
    tiling = decoder_for(settings, family, plan).tiling
    pipeline = load_pipeline(model, plan, served_dtype(settings), pool, tiling, components)
    pipeline.defaults = request_defaults(limits, pipeline.family, pipeline.defaults)
    attention = serve_attention(settings.attention, pipeline)  # timed alone: before any other call

    def housekeeping() -> bool:  # idle a while: give back what bursts left; True once all is back
        freed = pool.trim(idle_for_s=IDLE_TRIM_S)
        freed_host = release_freed_host_memory()
        idle = sum(s.bytes_idle for s in pool.stats().values())
        if freed or freed_host:
            log.info("idle: %d pooled bytes and %d resident bytes given back", freed, freed_host)
        return idle == 0

    lanes = pipeline.lane_threads
    log.info(
        "torch may run %d intra-op threads in all (--threads; default: the CPU quota)%s",
        threads,
        f"; each lane runs {lanes}" if lanes is not None else "",
    )
    per_request = request_limits(limits, pipeline.family)
    budget = step_budget(settings, pipeline, threads)
    # after the step budget's timed calls (a compile beside them slowed them and the start: the
    # built-in model's cold start to ready 34.6 s against 9.9 s eager), before the lanes copy the
    # pipeline; in the background, giving way while the step loops have work
    give_way = GiveWay()
    compiling = start_compiling(CompileSettings.of(settings), pipeline, limits.max_batch, compiling, give_way)
    if said := float8_speed(model.quantize, compiling.mode):
        log.info("%s", said)
    bound_decoder(per_request.max_image_pixels)  # Pillow's bomb check: a second fence behind uploads.py's
    return Service(
        pipeline,
        model.served_name,
        per_request,
        max_queue=limits.max_queue,
        max_queue_per_key=limits.key_queue_limit,
        max_background_queue=limits.max_background_queue,
        max_batch=limits.max_batch,
        step_budget=budget,
        step_timeout_s=limits.step_timeout_s,
        failures_unready=limits.failures_unready,
        inject_faults=limits.inject_faults,
        tidy=housekeeping,
        threads=threads,
        background=give_way,
        attention=attention.view(),
    )


def load_pipeline(
    model: ModelSettings,
    plan: ParallelPlan,
    dtype: torch.dtype,
    pool: ActivationPool,
    vae_tiling: VaeTiling,
    components: Components | None,
) -> Pipeline:
    """The model's weights placed by `plan`, and the adapters and ControlNets served beside it."""
    if components is not None:
        log.warning("serving parts built by the caller, not the weights of %s", model.model)
    pipeline = Pipeline.load(
        model.model,
        plan=plan,
        dtype=dtype,
        pool=pool,
        quantize=model.quantize,
        denoiser_file=model.denoiser_file,
        vae_tiling=vae_tiling,
        components=components,
    )
    for name, path in model.adapters.items():  # a file that does not fit stops the start, naming it
        pipeline.add_adapter(read_adapter(name, path, pipeline.family))
        log.info("LoRA %s: %s", name, pipeline.adapters.loaded[name].describe())
    for name, folder in model.controlnets.items():  # one of another family stops the start, naming it
        pipeline.controlnets.load(name, folder)
        log.info("ControlNet %s: %s", name, folder)
    return pipeline


def start_compiling(
    compiling: CompileSettings,
    pipeline: Pipeline,
    max_batch: int,
    stats: CompileStats | None,
    give_way: GiveWay,
) -> CompileStats:
    """The denoiser compiled in the background per shape bucket (`stats` shows the progress),
    giving way while the step loops have work."""
    return compile_pipeline(
        pipeline,
        compiling.compile,
        compiling.compile_sizes or (pipeline.defaults.size,),
        max_batch,
        compiling.cache_dir,
        stats,
        background=True,
        budget_s=compiling.compile_budget_s,
        give_way=give_way,
        route=compiling.compile_route,
        kept_bytes=compiling.compiled_bytes,
    )


def step_budget(settings: Settings, pipeline: Pipeline, threads: int) -> float | None:
    """`--step-budget` in native rows; auto: the knee at the native size, said with where it falls
    at larger sides (and how many rows the budget lets in there)."""
    if settings.step_budget != "auto":
        return None if settings.step_budget == "off" else float(settings.step_budget)
    family = pipeline.family
    native = family.native_size
    sides = [s for s in (native, 2 * native, 4 * native) if s * s <= pixel_limit(settings, family)] or [
        native
    ]
    device = pipeline.shard.devices[0]
    lane_threads = pipeline.lane_threads or threads
    dtype = served_dtype(settings)
    knees = step_knees(family, dtype, device, lane_threads, sides, settings.max_batch, settings.cache_dir)
    budget = float(knees[native])
    where = ", ".join(
        f"{side} px: knee {knee} rows, budget {max(1, int(budget * native**2 / side**2))}"
        for side, knee in knees.items()
    )
    log.info("step budget: %g native rows (the knee at %d px; --step-budget); %s", budget, native, where)
    return budget


RUNNER_STOP_S = 5.0  # for the video runner to give its jobs back before the process ends (at least)


def start_videos(
    jobs: JobSettings,
    service: Service,
    runtime: Runtime,
    *,
    inject_faults: bool = False,
    notify: Callable[[str, str], None] | None = None,
) -> VideoRunner:
    """The job store opened (ConfigError if it cannot be) and the runner taking its jobs (`notify`:
    a job's event, before its end is stored)."""
    store = open_job_store(jobs.job_store, service.name, jobs.video_lease_s, runs=True)
    log.info("video jobs in %s", shown(jobs.job_store))
    runtime.videos = VideoRunner(
        store,
        service,
        fps=jobs.video_fps or service.clip.fps,
        expiry_s=jobs.video_expiry_s,
        max_bytes=jobs.video_store_bytes,
        lease_s=jobs.video_lease_s,
        takes_work=lambda: runtime.takes_work,
        max_running=jobs.max_running_videos,
        inject_faults=inject_faults,
        notify=notify,
    )
    return runtime.videos


def start_webhooks(hooks: WebhookSettings, job_store: str, model: str) -> Webhooks:
    """The outbox opened beside `model`'s jobs (ConfigError if it cannot be) and its deliverer,
    which the app starts once it has given it a confirm per producer."""
    return Webhooks(
        open_outbox(job_store, model),
        hooks.webhook,
        signing_secret(hooks) or "",
        first_retry_s=hooks.webhook_retry_s,
        retry_for_s=hooks.webhook_retry_for_s,
        timeout_s=hooks.webhook_timeout_s,
    )


def start_batches(
    batch: BatchSettings,
    job_store: str,
    service: Service,
    runtime: Runtime,
    max_batch: int,
    notify: Callable[[str, str], None] | None = None,
) -> BatchRunner:
    """The Batch API's store opened in the job store (ConfigError if it cannot be) and the runner
    taking its lines, at background priority, while the step loops can take work (`notify`: a
    batch's webhook event, before its end is stored)."""
    store = open_batch_store(job_store, service.name)
    translate, refusal = batch_endpoints(service)
    return BatchRunner(
        store,
        service,
        translate,
        refusal,
        rows_in_flight=batch.batch_rows_in_flight or 2 * max_batch,
        lease_s=batch.batch_lease_s,
        file_expiry_s=batch.batch_file_expiry_s,
        max_bytes=batch.batch_store_bytes,
        takes_work=lambda: runtime.takes_work,
        notify=notify,
    )


async def _load(app: FastAPI) -> None:
    runtime: Runtime = app.state.runtime
    settings: Settings = app.state.settings
    started = time.perf_counter()
    try:
        service = await asyncio.to_thread(
            load_service, settings, app.state.plan, runtime.compiling, app.state.components
        )
        webhooks = None
        if settings.webhook:  # the producers' events, from the outbox to the operator's endpoints
            webhooks = app.state.webhooks = await asyncio.to_thread(
                start_webhooks, WebhookSettings.of(settings), settings.job_store, service.name
            )
        if service.clip is not None:  # a video model: /v1/videos' jobs, from the job store
            jobs = JobSettings.of(settings)
            notify = webhooks.notify if webhooks is not None else None
            app.state.videos = await asyncio.to_thread(
                start_videos, jobs, service, runtime, inject_faults=settings.inject_faults, notify=notify
            )
            if webhooks is not None:
                webhooks.confirms["video."] = video_confirm(app.state.videos.store)
        # the Batch API's lines, from the job store, in the rows interactive requests leave
        app.state.batches = await asyncio.to_thread(
            start_batches,
            BatchSettings.of(settings),
            settings.job_store,
            service,
            runtime,
            settings.max_batch,
            webhooks.notify if webhooks is not None else None,
        )
        if webhooks is not None:
            webhooks.confirms["batch."] = confirm_batch(app.state.batches.store)
            webhooks.start()
    except Exception as err:
        runtime.status, runtime.error = "failed", f"{type(err).__name__}: {err}"
        # the cause is in the log (here, and as serve's last line); its traceback only with --debug
        log.error(
            "cannot serve %s: %s", settings.model, runtime.error, exc_info=err if settings.debug else None
        )
        if app.state.on_fatal is not None:
            app.state.on_fatal()
        return
    runtime.service, runtime.load_seconds = service, time.perf_counter() - started
    if runtime.status == "loading":  # not draining already
        runtime.status = "ready"
    replicas = service.pipeline.replicas
    each = f"each of {len(replicas)} replicas" if len(replicas) > 1 else "one replica"
    log.info("placed (%s):\n%s", each, service.pipeline.shard)
    # what startup made (modules, the model's objects) moved out of the collector's way: a full
    # collection no longer walks them while serving, and exit no longer sweeps them (~2 s)
    gc.freeze()
    lanes = len(service.loops)
    log.info(  # last: everything above is what is now serving
        "ready: %s loaded in %.1f s (%d step-loop lane%s)",
        runtime.model_name,
        runtime.load_seconds,
        lanes,
        "s" if lanes > 1 else "",
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    runtime: Runtime = app.state.runtime
    settings: Settings = app.state.settings
    if settings.inject_faults:
        log.warning(
            "fault injection is on (DIFFSHARD_INJECT_FAULTS): prompts holding [[fail]], [[oom]], [[hang]], "
            "[[slow]], [[slow-encode]], [[decode]] or [[kill]] fail on purpose; for tests, never for serving"
        )
    exporter = None
    if settings.metrics_port and app.state.serve_metrics:  # Prometheus scrapes its own port
        try:
            exporter, _ = start_http_server(settings.metrics_port, settings.host, app.state.metrics.registry)
        except OSError as err:
            log.error("cannot serve metrics on port %d: %s (set --metrics-port)", settings.metrics_port, err)
            raise
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    loading = asyncio.create_task(_load(app))
    try:
        yield
    finally:
        if exporter is not None:
            exporter.shutdown()
        runtime.status = "draining" if runtime.status != "failed" else runtime.status
        await asyncio.shield(loading)  # a load in flight cannot be interrupted; let it end
        videos = getattr(app.state, "videos", None)
        if videos is not None:
            videos.stop()  # takes no more jobs; those the close below cuts short go back to the queue
        webhooks = getattr(app.state, "webhooks", None)
        if webhooks is not None:
            webhooks.stop()  # what it has not delivered stays in the outbox, for the next start
        batch_runner = getattr(app.state, "batches", None)
        if batch_runner is not None:
            batch_runner.stop()  # claims no more; its running lines are cancelled, back to their batches
        if runtime.service is not None:
            await asyncio.to_thread(runtime.service.close)
        if videos is not None:  # a video being encoded and written is waited for, as a request is
            await asyncio.to_thread(videos.join, max(RUNNER_STOP_S, settings.drain_timeout_s))
        if batch_runner is not None:  # the lines ending now keep their results, a while
            await asyncio.to_thread(batch_runner.join, RUNNER_STOP_S)
        if webhooks is not None:  # a POST in flight, a while (its event comes due again elsewhere)
            await asyncio.to_thread(webhooks.join, RUNNER_STOP_S)


def create_app(
    settings: Settings,
    plan: ParallelPlan | None = None,
    *,
    registry: CollectorRegistry | None = None,
    on_fatal: Callable[[], None] | None = None,
    serve_metrics: bool = True,
    components: Components | None = None,
) -> FastAPI:
    """The app; it loads the model with `plan` (made from the settings if None). Its metrics go
    on `registry` (a fresh one by default), served on the metrics port by the lifespan unless
    `serve_metrics` is False (`serve` binds that port itself, before anything loads). `on_fatal`
    is called if the model cannot load (`serve` stops the server). `components`: the model's parts
    built already (`load_service`); None (always, in `serve`): read from the folder."""
    settings = decide_dtype(settings)  # `serve` did already; an app made in tests does here
    app = FastAPI(  # /docs is api/docs.py's (offline, under a CSP); no /redoc
        title="diffshard", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.settings, app.state.plan, app.state.on_fatal = settings, plan, on_fatal
    # the routes' slices: what the API reads of the settings, and nothing else
    app.state.server_settings = ServerSettings.of(settings)
    app.state.model_settings, app.state.limit_settings = (
        ModelSettings.of(settings),
        LimitSettings.of(settings),
    )
    app.state.serve_metrics, app.state.components = serve_metrics, components
    app.state.batch_settings = BatchSettings.of(settings)
    app.state.makes_videos = read_family(settings.model).clip is not None  # configs only
    # an edit form's text fields: a JSON body's bytes, and its controls' images in base64
    app.state.form_text_bytes = settings.max_body_bytes + _control_bytes(settings)
    app.state.api_keys = read_api_keys(settings.api_key_file) if settings.api_key_file else None
    app.state.admin_keys = read_api_keys(settings.admin_key_file) if settings.admin_key_file else None
    quantization = describe(settings.quantize, settings.denoiser_file)
    runtime = Runtime(settings.served_name, settings.dtype, settings.max_queue, quantization)
    runtime.dtype_choice = settings.dtype_choice or {"dtype": settings.dtype, "reason": "--dtype"}
    app.state.runtime = runtime
    runtime.compiling = CompileStats(str(settings.compile))
    app.state.metrics = metrics = Metrics(
        registry or CollectorRegistry(),
        runtime.snapshot,
        inject_faults=settings.inject_faults,
        webhooks=lambda: hooks.figures() if (hooks := getattr(app.state, "webhooks", None)) else None,
    )
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(routes.router)
    app.include_router(admin.router)
    app.include_router(videos.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(playground.router)
    app.include_router(docs.router)
    install_openapi(
        app, _bounds(settings, app.state.api_keys is not None or app.state.admin_keys is not None)
    )
    image_settings = "DIFFSHARD_MAX_IMAGE_BYTES, DIFFSHARD_MAX_EDIT_IMAGES, DIFFSHARD_MAX_BODY_BYTES"
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        read_timeout_s=settings.read_timeout_s,
        whole=_control_bodies(settings),
        by_path={
            "/v1/images/edits": (settings.edit_body_bytes + _control_bytes(settings), image_settings),
            # a batch's JSONL input beside the form's fields
            "/v1/files": (settings.batch_file_bytes + settings.max_body_bytes, "DIFFSHARD_BATCH_FILE_BYTES"),
            # a video's first frame (input_reference) beside its fields
            "/v1/videos": (
                settings.max_image_bytes + settings.max_body_bytes,
                "DIFFSHARD_MAX_IMAGE_BYTES, DIFFSHARD_MAX_BODY_BYTES",
            ),
        },
    )
    app.add_middleware(TrustedHosts, allowed_hosts=settings.trusted_hosts)  # before any body is read
    app.router.redirect_slashes = False  # a redirect's Location would be built from the client's Host
    app.add_middleware(HttpMetrics, metrics=metrics, rejected=runtime.http_rejected)  # it sees the 413s too
    app.add_middleware(RequestContext)  # outermost: every answer carries the request id
    return app


def _control_bytes(settings: Settings) -> int:
    """With ControlNets served (or loadable at runtime), a body may carry MAX_CONTROLS control
    images in base64 (a generation's in its JSON, an edit's in its `control` field)."""
    if not (settings.controlnet or settings.controlnet_dir):
        return 0
    return MAX_CONTROLS * (4 * math.ceil(settings.max_image_bytes / 3) + DATA_URL_PREFIX)


def _control_bodies(settings: Settings) -> dict[str, tuple[int, str]]:
    if not _control_bytes(settings):
        return {}
    named = "DIFFSHARD_MAX_BODY_BYTES, DIFFSHARD_MAX_IMAGE_BYTES"
    return {"/v1/images/generations": (settings.max_body_bytes + _control_bytes(settings), named)}


def _bounds(settings: Settings, keyed: bool) -> Bounds:
    """What the OpenAPI document says of request bodies: these settings on this model."""
    family = read_family(settings.model)
    limits = request_limits(LimitSettings.of(settings), family)
    return Bounds(
        served_name=settings.served_name,
        max_n=limits.max_n,
        max_steps=limits.max_steps,
        max_prompt_chars=limits.max_prompt_chars,
        max_pixels=limits.max_pixels,
        max_work=limits.max_work,
        native_size=family.native_size,
        size_multiple=family.size_multiple,
        max_side=family.max_size,
        schedulers=tuple(family.schedulers),
        keyed=keyed,
        step_caches=tuple(family.step_caches),
        step_cache=settings.step_cache.wire(),
        alpha=family.alpha,
    )
