"""Every setting of the service, split by concern: flags of `python -m server serve` (and, for
those that shape a plan, of `python -m server plan`), or environment variables `DIFFSHARD_<NAME>`
(flags win). Validated once, at startup, into typed values (a device list, byte budgets per
device, a strategy), with messages that say what to fix; validation reads files (a model
folder's family, a GGUF header, a key file) and measures nothing.

One module per concern, each a pydantic model of its fields and their validators:

    server.py   ServerSettings    where to listen, who may call, connections, drain
    model.py    ModelSettings     the model, devices, placement, dtype, quantization, adapters, memory
    limits.py   LimitSettings     what a request may ask and gets by default; the step loop
    jobs.py     JobSettings       video jobs and their store
    batches.py  BatchSettings     the Batch API: its files, lines and bounds
    webhooks.py WebhookSettings   webhooks: endpoints, their secret, retries
    compile.py  CompileSettings   compiling, attention, the cache folder
    values.py   the typed values they parse into, and `Concern`, their base

`Settings` is all of them at once, flat, by multiple inheritance (vLLM's `VllmConfig` bundles
its configs as nested fields instead). Flat, because every flag and variable is one field's
name (`--max-batch`, `DIFFSHARD_MAX_BATCH`), as deploy manifests, compose files and docs write
them: nested models would need an alias per field to keep those, and `settings.max_batch` reads
as before. A layer is handed its concern's slice, `LimitSettings.of(settings)`: a model of those
fields alone (not validated again), so what it may read is what its type says.
"""

from __future__ import annotations

from typing import Any

from pydantic import PrivateAttr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.pipeline.loading.folder import read_family
from server.settings.batches import BatchSettings
from server.settings.compile import CompileSettings
from server.settings.jobs import JobSettings
from server.settings.limits import LimitSettings
from server.settings.model import ModelSettings
from server.settings.server import ServerSettings
from server.settings.values import Concern
from server.settings.webhooks import WebhookSettings

__all__ = [
    "CONCERNS",
    "BatchSettings",
    "CompileSettings",
    "Concern",
    "JobSettings",
    "LimitSettings",
    "ModelSettings",
    "ServerSettings",
    "Settings",
    "WebhookSettings",
]

# In the order `serve --help` lists their flags.
CONCERNS: tuple[type[Concern], ...] = (
    ServerSettings,
    ModelSettings,
    LimitSettings,
    JobSettings,
    BatchSettings,
    WebhookSettings,
    CompileSettings,
)


class Settings(
    ServerSettings,
    ModelSettings,
    LimitSettings,
    JobSettings,
    BatchSettings,
    WebhookSettings,
    CompileSettings,
    BaseSettings,
):
    # hide_input_in_errors: an error shows no input, which may hold the webhooks' secret
    model_config = SettingsConfigDict(
        env_prefix="DIFFSHARD_",
        frozen=True,
        protected_namespaces=(),
        validate_default=True,
        hide_input_in_errors=True,
    )
    # what `--dtype auto` chose and why (server.startup.decide_dtype): carried to /v1/stats, not a flag
    _dtype_choice: dict[str, Any] | None = PrivateAttr(None)

    @property
    def dtype_choice(self) -> dict[str, Any] | None:
        return self._dtype_choice

    @model_validator(mode="after")
    def _step_cache_fits(self) -> Settings:
        """A check across concerns (a request's default against the model's family), once every
        field is valid; its message names the flag, as pydantic's field errors do."""
        family = read_family(self.model)
        if self.step_cache.policy not in family.step_caches:
            served = ", ".join(family.step_caches)
            raise ValueError(
                f"--step-cache (DIFFSHARD_STEP_CACHE): {self.step_cache.policy!r} does not fit a "
                f"{family.name} model: use one of {served}"
            )
        return self
