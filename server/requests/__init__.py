"""What a request asks for, as plain values: the HTTP layer builds them, the service queues and
limits them, the pipeline runs them. No torch here: any layer may import these."""

from server.requests.clip import frames_for, seconds_of
from server.requests.control import MAX_CONTROLS, Control
from server.requests.edit import Edit
from server.requests.generation import KINDS, MAX_MODEL_STEPS, SEED_LIMIT, Defaults, GenerationRequest
from server.requests.step_cache import (
    DEFAULT_INTERVAL,
    DEFAULT_THRESHOLD,
    MAX_INTERVAL,
    StepCache,
    parse_step_cache,
)

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_THRESHOLD",
    "KINDS",
    "MAX_CONTROLS",
    "MAX_INTERVAL",
    "MAX_MODEL_STEPS",
    "SEED_LIMIT",
    "Control",
    "Defaults",
    "Edit",
    "GenerationRequest",
    "StepCache",
    "frames_for",
    "parse_step_cache",
    "seconds_of",
]
