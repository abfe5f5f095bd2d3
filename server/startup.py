"""What the settings plan on this host, before a weight loads: the denoiser's split (`plan_for`,
with the batch reserve fitted), the VAE decoder's tiling, the activation pool's budgets, whether
the quantization asked for runs on the devices, and what one request may ask of the model and
gets when it names nothing (`request_limits`, `request_defaults`). `serve` and `plan` both use it."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

import torch

from server.config import Settings
from server.engine import ParallelPlan
from server.engine.hardware.threads import cpu_quota
from server.engine.quantize import refusal
from server.engine.runtime.compile import CompileMode
from server.engine.runtime.graphs import compile_route
from server.engine.runtime.pool import ANY_DEVICE, default_pool_budgets
from server.engine.runtime.sdpa_backend import AttentionSetting
from server.errors import ConfigError, PlanError
from server.pipeline.families import Family
from server.pipeline.loading.model_plan import largest_side, plan_model
from server.pipeline.loading.vae_tiling import DecoderMemory, decoder_memory
from server.requests.clip import work_limit
from server.requests.generation import Defaults
from server.serving import Limits

log = logging.getLogger("diffshard")


def plan_for(
    settings: Settings, family: Family, *, folder: Path | None = None, **options: object
) -> ParallelPlan:
    """The plan `serve` runs: reserve for `max_batch` rows at the largest allowed image."""
    options.setdefault("side", largest_side(family, pixel_limit(settings, family)))
    return plan_model(
        family,
        settings.devices,
        options.pop("strategy", settings.strategy),
        dtype=settings.torch_dtype,
        batch=settings.max_batch,
        max_memory=settings.max_memory,
        folder=folder,
        parallel=options.pop("parallel", settings.parallel),
        layout=settings.layout,
        threads=settings.threads or cpu_quota(),
        pick_threads=settings.threads is None,  # --threads N: a lone CPU worker runs N
        costs=settings.costs,
        cache_dir=settings.cache_dir,
        quantize=settings.quantize,
        denoiser_file=settings.denoiser_file,
        controlnets=settings.controlnets,
        **options,
    )


def fitted_plan(
    settings: Settings, family: Family, *, folder: Path | None = None, **options: object
) -> tuple[Settings, ParallelPlan]:
    """`plan_for`, and the settings it holds for. With --max-batch left to its default, a reserve
    for that many rows that does not fit beside the weights is halved until it does (down to a
    lone request's rows): a video model's 16 rows of 81 frames would not fit one GPU. Said in the
    log; an explicit --max-batch is kept, and a plan that fits at no batch fails at the smallest."""
    asked = batch = settings.max_batch
    fixed = "max_batch" in settings.model_fields_set
    while True:
        try:
            plan = plan_for(settings, family, folder=folder, **dict(options))
        except PlanError:
            if fixed or batch // 2 < family.lone_rows:
                raise
            batch //= 2
            settings = settings.model_copy(update={"max_batch": batch})
            continue
        if batch != asked:
            log.warning(
                "--max-batch: the default's activation reserve does not fit beside the weights, so a "
                "step runs at most %d rows (set --max-batch to choose; `plan` shows the reserve)",
                batch,
            )
        return settings, plan


def decoder_for(
    settings: Settings, family: Family, plan: ParallelPlan, side: int | None = None
) -> DecoderMemory:
    """The VAE decoder's predicted peak for the largest allowed image (or `side`²; a video model's
    longest admitted clip at it), whole and in tiles, and whether `--vae-tiling` tiles: auto
    weighs it against the plan's activation reserve on the VAE's device (the first stage's, where
    the Pipeline puts it), if it has a budget."""
    first = plan.replicas[0]
    device = next(d for d in first.devices if d.device == first.stages[0].device)
    reserve = device.activation_reserve if device.budget is not None else None
    return decoder_memory(
        family.config.vae,
        side=side or largest_side(family, pixel_limit(settings, family)),
        default_tile=family.native_size,
        dtype=family.held_dtype("vae", settings.torch_dtype),
        frames=family.clip and family.clip.longest(settings.max_batch),  # a video's longest, whole
        setting=settings.vae_tiling,
        reserve=reserve,
    )


def check_runs_here(settings: Settings) -> None:
    """What the settings ask that this host cannot run stops the start now, in one line:
    quantization a device lacks, a compile route this PyTorch lacks, an attention backend
    named without a CUDA device."""
    check_quantization_runs(settings)
    check_compile_route(settings)
    check_attention(settings)


def check_quantization_runs(settings: Settings) -> None:
    """A mode a device cannot run stops the start, in one line naming the device."""
    for mode in set(settings.quantize.values()):
        for device in settings.devices:
            if problem := refusal(mode, device):
                raise ConfigError(f"--quantize (DIFFSHARD_QUANTIZE): {problem}")


def check_compile_route(settings: Settings) -> None:
    """`--compile-route aot` on a PyTorch without it stops the start, in one line."""
    if settings.compile != CompileMode.OFF:
        try:
            compile_route(settings.compile_route)
        except ValueError as err:
            raise ConfigError(f"{err} (DIFFSHARD_COMPILE_ROUTE)") from None


def check_attention(settings: Settings) -> None:
    """A backend named by `--attention` orders CUDA's attention: with no CUDA device among the
    devices, the start stops now, in one line, not after the model loaded."""
    if settings.attention not in (AttentionSetting.AUTO, AttentionSetting.DEFAULT) and not any(
        torch.device(device).type == "cuda" for device in settings.devices
    ):
        raise ConfigError(
            f"--attention {settings.attention} orders PyTorch's CUDA attention backends, and "
            f"{','.join(settings.devices)} has no CUDA device: use --attention auto or default "
            "(DIFFSHARD_ATTENTION)"
        )


def pool_budgets(settings: Settings) -> dict[str, int]:
    """The pool's idle budget per device: the defaults, overridden by --pool-budget (one SIZE for
    every device, or device=SIZE for some)."""
    budgets = default_pool_budgets(settings.devices)
    if ANY_DEVICE in settings.pool_budget:
        budgets = dict.fromkeys([*budgets, ANY_DEVICE], settings.pool_budget[ANY_DEVICE])
    return budgets | {d: b for d, b in settings.pool_budget.items() if d != ANY_DEVICE}


def pixel_limit(settings: Settings, family: Family) -> int:
    """`max_pixels`, or by default the family's multiple of the model's native area (4x for SD:
    SD-1.5 1024², the built-in 128²; FLUX.1 less, so two 24 GiB GPUs hold its default plan)."""
    return settings.max_pixels or int(family.default_area * family.native_size**2)


def request_limits(settings: Settings, family: Family) -> Limits:
    """What one request may ask of a `family` model under these settings."""
    clip, max_pixels = family.clip, pixel_limit(settings, family)
    explicit_work = "max_work" in settings.model_fields_set
    return Limits(
        max_n=settings.max_n,
        max_steps=settings.max_steps,
        max_pixels=max_pixels,
        max_prompt_chars=settings.max_prompt_chars,
        max_work=work_limit(settings.max_work, clip, explicit=explicit_work),
        native_pixels=family.native_size**2,
        request_timeout_s=settings.request_timeout_s,
        video_timeout_s=settings.video_timeout_s,
        max_image_bytes=settings.max_image_bytes,
        max_image_pixels=settings.max_image_pixels or 4 * max_pixels,
        max_edit_images=settings.max_edit_images,
        max_clip=math.inf if clip is None else clip.max_clip(settings.max_batch, max_pixels),
        clip=clip,
    )


def request_defaults(settings: Settings, family: Family, defaults: Defaults) -> Defaults:
    """The model's `defaults` (its folder's, else its family's) with the operator's steps and
    guidance where set (`--default-steps`, `--default-guidance`); ConfigError where one cannot
    be served: steps over `--max-steps`, guidance to a model without a guidance input."""
    steps, guidance = settings.default_steps, settings.default_guidance
    if steps is not None and steps > settings.max_steps:
        raise ConfigError(
            f"--default-steps (DIFFSHARD_DEFAULT_STEPS): {steps} is over --max-steps ({settings.max_steps}): "
            "a request naming none would be refused"
        )
    if guidance is not None and guidance != family.default_guidance and not family.takes_guidance:
        raise ConfigError(
            f"--default-guidance (DIFFSHARD_DEFAULT_GUIDANCE): a {family.name} model has no guidance input"
            ": leave it unset (a negative prompt's true_cfg_scale guides it)"
        )
    return replace(
        defaults,
        steps=defaults.steps if steps is None else steps,
        guidance_scale=defaults.guidance_scale if guidance is None else guidance,
        step_cache=settings.step_cache,
    )
