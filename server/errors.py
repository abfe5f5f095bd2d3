"""Every error diffshard raises on purpose, in one tree; `server/api/errors.py` maps it to HTTP.

    DiffshardError
    ├── ConfigError              startup: the message says which setting or file to fix
    │   ├── DeviceError          a device this host does not have, a malformed device or size
    │   ├── PlanError            a split that cannot be made or cannot fit its budgets
    │   └── ModelFolderError     a model folder that cannot be served
    ├── InvalidRequest           bad input: names the field and the limit (400)
    └── Rejected                 a request the service did not finish; `reason` is its stats key
        ├── Unavailable          the service cannot take it now (503)
        │   ├── NotReady         the model is loading, or failed to load
        │   ├── Overloaded       the queue is full; `retry_after` seconds
        │   │   └── KeyOverloaded    one API key's share of the queue is full (429)
        │   ├── Draining         the server is shutting down
        │   ├── OutOfMemory      the device ran out of memory during the request
        │   └── WorkerLost       a helper thread of the request's call died (it is restarted)
        ├── DeadlineExceeded     past the request timeout (504)
        ├── Cancelled            the client went away
        └── StepFailed           a start, step or decode raised (500)

`ConfigError` and `InvalidRequest` are also `ValueError`s, so settings validators and callers
that expect a ValueError keep working. This module imports nothing from diffshard: every layer
may raise these.
"""

from __future__ import annotations


class DiffshardError(Exception):
    """Base of every error diffshard raises on purpose."""


class ConfigError(DiffshardError, ValueError):
    """A setting, device, plan or model folder that cannot work; raised before serving starts."""


class DeviceError(ConfigError):
    """A device name that does not exist on this host, or a malformed device or size."""


class PlanError(ConfigError):
    """A plan that cannot be made or cannot fit; the message says what to change."""


class ModelFolderError(ConfigError):
    """A model folder that cannot be served; the message says what to fix."""


class InvalidRequest(DiffshardError, ValueError):
    """A request that cannot run. `field` names the input, `limit` the setting that bounds it.

    Model invariants (sizes the VAE can take, the schedulers a family supports) carry no limit;
    policy limits (max steps, max pixels, ...) name their setting, e.g. DIFFSHARD_MAX_STEPS.
    """

    def __init__(self, field: str, message: str, limit: str | None = None) -> None:
        super().__init__(f"{field}: {message}" + (f" ({limit})" if limit else ""))
        self.field = field
        self.message = message
        self.limit = limit


class Rejected(DiffshardError):
    """A request the service did not finish; `reason` is its key in the stats."""

    reason = "rejected"


class Unavailable(Rejected):
    reason = "unavailable"


class NotReady(Unavailable):
    """No model to serve yet (loading) or at all (failed); `status` says which."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.reason = self.status = status


class Overloaded(Unavailable):
    reason = "queue_full"

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class KeyOverloaded(Overloaded):
    reason = "key_queue_full"

    def __init__(self, retry_after: int, share: int) -> None:
        Unavailable.__init__(
            self, f"this API key has {share} requests waiting, its most; retry in {retry_after} s"
        )
        self.retry_after = retry_after


class Draining(Unavailable):
    reason = "draining"


class OutOfMemory(Unavailable):
    reason = "out_of_memory"


class WorkerLost(Unavailable):
    reason = "worker_lost"


class GroupBroken(RuntimeError):
    """Another rank of a sequence group failed during this call (its own error is the cause)."""


class DeadlineExceeded(Rejected):
    reason = "deadline"


class Cancelled(Rejected):
    reason = "cancelled"


class StepFailed(Rejected):
    reason = "failed"


class StoreUnavailable(Unavailable):
    """The job store (Redis) did not answer; the request may be tried again."""

    reason = "job_store_unavailable"
    retry_after = 2  # seconds: Redis restarting or failing over is back within a few

    def __init__(self) -> None:
        super().__init__("the video job store cannot be reached; retry shortly")


class StoreRefused(RuntimeError):
    """The job store answered but would not keep a job's content (Redis at its `maxmemory` or its
    largest value, a full disk): trying again refuses again, so the job fails with this message."""
