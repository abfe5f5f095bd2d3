"""Webhooks: the operator's endpoints, the secret their events are signed with, and how long and
how often an event is tried. What `serving/webhooks.py`'s deliverer is built from; its outbox
lives in the job store (`--job-store`).

The secret comes from a file (`--webhook-secret-file`, a mounted Secret) or the environment
(`DIFFSHARD_WEBHOOK_SECRET`), never a flag: a process's arguments are visible to every user of
the host. It is never shown: not in `--help`, a log line, or a validation error (inputs hidden).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Self

from pydantic import BeforeValidator, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import NoDecode

from server.serving.webhooks import SECRET_PREFIX, check_secret, check_url
from server.settings.values import Concern

SECRET_SETTINGS = "--webhook-secret-file (DIFFSHARD_WEBHOOK_SECRET_FILE) or DIFFSHARD_WEBHOOK_SECRET"


def _urls(value: object) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else str(value or "").split(",")
    urls = tuple(check_url(str(item).strip()) for item in items if str(item).strip())
    if len(set(urls)) < len(urls):
        raise ValueError("an endpoint is named twice")
    return urls


Endpoints = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_urls)]


class WebhookSettings(Concern):
    title = "webhooks: signed events (a video or batch ended) POSTed to the operator's endpoints"
    # a validation error shows no input: the secret is one
    model_config = ConfigDict(hide_input_in_errors=True)

    webhook: Endpoints = Field(
        (),
        description="an endpoint (http:// or https:// URL) that receives every event, signed as "
        "Standard Webhooks are (repeat the flag, or comma-separate the variable); needs a secret",
        json_schema_extra={"repeatable": True, "metavar": "URL"},
    )
    webhook_secret_file: Path | None = Field(
        None,
        description="a file holding the whsec_ secret events are signed with (OpenAI's format); or the "
        "secret itself in DIFFSHARD_WEBHOOK_SECRET",
    )
    webhook_secret: SecretStr | None = Field(
        None,
        description="the whsec_ secret itself: from the environment only (a flag shows in the process list)",
        json_schema_extra={"env_only": True},
    )
    webhook_retry_s: float = Field(
        5, gt=0, le=3600, description="seconds before an event's first retry; each next waits twice as long"
    )
    webhook_retry_for_s: float = Field(
        86400, ge=1, description="seconds an event is retried for (from its move); then dropped, counted"
    )
    webhook_timeout_s: float = Field(
        10, gt=0, le=300, description="seconds to connect, send and read an answer, each, per POST"
    )

    @model_validator(mode="after")
    def _signed(self) -> Self:
        """A secret, well formed, for the endpoints; named by its settings, never shown."""
        if self.webhook_secret_file is not None and self.webhook_secret is not None:
            raise ValueError(f"give the webhook secret once: {SECRET_SETTINGS}, not both")
        secret = signing_secret(self)
        if secret is None:
            if self.webhook:
                raise ValueError(f"--webhook (DIFFSHARD_WEBHOOK) needs a secret: {SECRET_SETTINGS}")
            return self
        if problem := check_secret(secret):
            raise ValueError(f"{SECRET_SETTINGS}: {problem}")
        return self


def signing_secret(settings: WebhookSettings) -> str | None:
    """The secret, from its file or the environment (ValueError naming the file it cannot read)."""
    if settings.webhook_secret is not None:
        return settings.webhook_secret.get_secret_value().strip()
    if settings.webhook_secret_file is None:
        return None
    if str(settings.webhook_secret_file).startswith(SECRET_PREFIX):
        # the secret itself (`--webhook-secret` abbreviates this flag): never shown, not even as a path
        raise ValueError(
            "--webhook-secret-file (DIFFSHARD_WEBHOOK_SECRET_FILE) names a secret, not a file: write the "
            "secret into a file, or set DIFFSHARD_WEBHOOK_SECRET"
        )
    try:
        return settings.webhook_secret_file.read_text().strip()
    except OSError as err:
        raise ValueError(
            f"--webhook-secret-file (DIFFSHARD_WEBHOOK_SECRET_FILE): cannot read "
            f"{settings.webhook_secret_file}: {err.strerror}"
        ) from None
