"""What the settings plan on this host, before a weight loads: the weights' dtype (`--dtype
auto` decided, measured where it must be: `decide_dtype`), the denoiser's split (`plan_for`,
with the batch reserve fitted), the VAE decoder's tiling, the activation pool's budgets, whether
the quantization asked for runs on the devices, and what one request may ask of the model and
gets when it names nothing (`request_limits`, `request_defaults`). `serve` and `plan` both use it."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

import torch

from server.engine import ParallelPlan
from server.engine.hardware.devices import auto_dtype
from server.engine.hardware.threads import cpu_quota
from server.engine.planning.precision import DtypeChoice, choose_cpu_dtype
from server.engine.quantize import refusal
from server.engine.runtime.compile import CompileMode
from server.engine.runtime.graphs import compile_route
from server.engine.runtime.pool import ANY_DEVICE, default_pool_budgets
from server.engine.runtime.sdpa_backend import AttentionSetting
from server.errors import ConfigError, PlanError
from server.pipeline.families import Family, meta_denoiser
from server.pipeline.loading.folder import read_family
from server.pipeline.loading.model_plan import largest_side, plan_model
from server.pipeline.loading.vae_tiling import DecoderMemory, decoder_memory
from server.requests.clip import work_limit
from server.requests.generation import Defaults
from server.serving import Limits
from server.settings import CompileSettings, LimitSettings, ModelSettings, Settings
from server.settings.values import DTYPES

log = logging.getLogger("diffshard")


def served_dtype(settings: Settings) -> torch.dtype:
    """`--dtype`, as `decide_dtype` named it (auto, still undecided: `dtype_choice`)."""
    if settings.dtype != "auto":
        return DTYPES[settings.dtype]
    return DTYPES[dtype_choice(settings).dtype]


def dtype_choice(settings: Settings, family: Family | None = None) -> DtypeChoice:
    """What `--dtype auto` serves, and why: the GPUs' best (`auto_dtype`); with a CPU stage,
    bfloat16 only where the CPU runs the model's heaviest ops natively and measurably faster in it
    (`choose_cpu_dtype`: timed once per host and model, cached), else float32."""
    gpus = [d for d in settings.devices if d.startswith("cuda")]
    best = auto_dtype(gpus, settings.device_profile) if gpus else torch.bfloat16
    name = str(best).removeprefix("torch.")
    if len(gpus) == len(settings.devices):
        return DtypeChoice(name, "the GPUs' best")
    family = family or read_family(settings.model)
    latent = family.native_size // family.vae_scale_factor
    threads = settings.threads or cpu_quota()
    cpu = choose_cpu_dtype(meta_denoiser(family), latent, threads, settings.cache_dir, settings.max_batch)
    if cpu.dtype == "bfloat16" and best != torch.bfloat16:
        reason = f"{cpu.reason}; but the GPUs beside it serve {name}, which the CPU does not run natively"
        return replace(cpu, dtype="float32", reason=reason)
    return cpu


def decide_dtype(settings: Settings, family: Family | None = None) -> Settings:
    """The settings with `--dtype auto` decided (`dtype_choice`) and said in the log with its
    figures: where `serve`, `plan` and an app start, once, so what runs after reads a dtype
    already named, and /v1/stats why. Not a validator: deciding may time the model's ops, and
    settings validate in a blink."""
    if settings.dtype != "auto":
        return settings
    choice = dtype_choice(settings, family)
    log.info("--dtype auto: %s on %s: %s", choice.dtype, ",".join(settings.devices), choice.reason)
    decided = settings.model_copy(update={"dtype": choice.dtype})
    decided._dtype_choice = choice.view()
    return decided


def plan_for(
    settings: Settings, family: Family, *, folder: Path | None = None, **options: object
) -> ParallelPlan:
    """The plan `serve` runs: reserve for `max_batch` rows at the largest allowed image."""
    options.setdefault("side", largest_side(family, pixel_limit(settings, family)))
    return plan_model(
        family,
        settings.devices,
        options.pop("strategy", settings.strategy),
        dtype=served_dtype(settings),
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
        dtype=family.held_dtype("vae", served_dtype(settings)),
        frames=family.clip and family.clip.longest(settings.max_batch),  # a video's longest, whole
        setting=settings.vae_tiling,
        reserve=reserve,
    )


def check_runs_here(settings: Settings) -> None:
    """What the settings ask that this host cannot run stops the start now, in one line:
    quantization a device lacks, a compile route this PyTorch lacks, an attention backend
    named without a CUDA device."""
    check_quantization_runs(ModelSettings.of(settings))
    check_compile_route(CompileSettings.of(settings))
    check_attention(settings)


def check_quantization_runs(model: ModelSettings) -> None:
    """A mode a device cannot run stops the start, in one line naming the device."""
    for mode in set(model.quantize.values()):
        for device in model.devices:
            if problem := refusal(mode, device):
                raise ConfigError(f"--quantize (DIFFSHARD_QUANTIZE): {problem}")


def check_compile_route(compiling: CompileSettings) -> None:
    """`--compile-route aot` on a PyTorch without it stops the start, in one line."""
    if compiling.compile != CompileMode.OFF:
        try:
            compile_route(compiling.compile_route)
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


def pool_budgets(model: ModelSettings) -> dict[str, int]:
    """The pool's idle budget per device: the defaults, overridden by --pool-budget (one SIZE for
    every device, or device=SIZE for some)."""
    budgets = default_pool_budgets(model.devices)
    if ANY_DEVICE in model.pool_budget:
        budgets = dict.fromkeys([*budgets, ANY_DEVICE], model.pool_budget[ANY_DEVICE])
    return budgets | {d: b for d, b in model.pool_budget.items() if d != ANY_DEVICE}


def pixel_limit(limits: LimitSettings, family: Family) -> int:
    """`max_pixels`, or by default the family's multiple of the model's native area (4x for SD:
    SD-1.5 1024², the built-in 128²; FLUX.1 less, so two 24 GiB GPUs hold its default plan)."""
    return limits.max_pixels or int(family.default_area * family.native_size**2)


def request_limits(limits: LimitSettings, family: Family) -> Limits:
    """What one request may ask of a `family` model under these limits."""
    clip, max_pixels = family.clip, pixel_limit(limits, family)
    explicit_work = "max_work" in limits.model_fields_set
    return Limits(
        max_n=limits.max_n,
        max_steps=limits.max_steps,
        max_pixels=max_pixels,
        max_prompt_chars=limits.max_prompt_chars,
        max_work=work_limit(limits.max_work, clip, explicit=explicit_work),
        native_pixels=family.native_size**2,
        request_timeout_s=limits.request_timeout_s,
        video_timeout_s=limits.video_timeout_s,
        max_image_bytes=limits.max_image_bytes,
        max_image_pixels=limits.max_image_pixels or 4 * max_pixels,
        max_edit_images=limits.max_edit_images,
        max_clip=math.inf if clip is None else clip.max_clip(limits.max_batch, max_pixels),
        clip=clip,
    )


def request_defaults(limits: LimitSettings, family: Family, defaults: Defaults) -> Defaults:
    """The model's `defaults` (its folder's, else its family's) with the operator's steps and
    guidance where set (`--default-steps`, `--default-guidance`); ConfigError where one cannot
    be served: steps over `--max-steps`, guidance to a model without a guidance input."""
    steps, guidance = limits.default_steps, limits.default_guidance
    if steps is not None and steps > limits.max_steps:
        raise ConfigError(
            f"--default-steps (DIFFSHARD_DEFAULT_STEPS): {steps} is over --max-steps ({limits.max_steps}): "
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
        step_cache=limits.step_cache,
    )
