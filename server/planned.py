"""What the settings plan on this host, before a weight loads: the denoiser's split (`plan_for`,
with the batch reserve fitted), the VAE decoder's tiling, the activation pool's budgets, and
whether the quantization asked for runs on the devices. `serve` and `plan` both use it."""

from __future__ import annotations

import logging
from pathlib import Path

from server.config import Settings
from server.engine import ParallelPlan
from server.engine.hardware.threads import cpu_quota
from server.engine.quantize import refusal
from server.engine.runtime.pool import ANY_DEVICE, default_pool_budgets
from server.errors import ConfigError, PlanError
from server.pipeline.families import Family
from server.pipeline.planning import largest_side, plan_model
from server.pipeline.tiling import DecoderMemory, decoder_memory

log = logging.getLogger("diffshard")


def plan_for(
    settings: Settings, family: Family, *, folder: Path | None = None, **options: object
) -> ParallelPlan:
    """The plan `serve` runs: reserve for `max_batch` rows at the largest allowed image."""
    options.setdefault("side", largest_side(family, settings.pixel_limit(family)))
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
        side=side or largest_side(family, settings.pixel_limit(family)),
        default_tile=family.native_size,
        dtype=family.held_dtype("vae", settings.torch_dtype),
        frames=family.clip and family.clip.longest(settings.max_batch),  # a video's longest, whole
        setting=settings.vae_tiling,
        reserve=reserve,
    )


def check_quantization_runs(settings: Settings) -> None:
    """A mode a device cannot run stops the start, in one line naming the device."""
    for mode in set(settings.quantize.values()):
        for device in settings.devices:
            if problem := refusal(mode, device):
                raise ConfigError(f"--quantize (DIFFSHARD_QUANTIZE): {problem}")


def pool_budgets(settings: Settings) -> dict[str, int]:
    """The pool's idle budget per device: the defaults, overridden by --pool-budget (one SIZE for
    every device, or device=SIZE for some)."""
    budgets = default_pool_budgets(settings.devices)
    if ANY_DEVICE in settings.pool_budget:
        budgets = dict.fromkeys([*budgets, ANY_DEVICE], settings.pool_budget[ANY_DEVICE])
    return budgets | {d: b for d, b in settings.pool_budget.items() if d != ANY_DEVICE}
