"""Serving: the step loop, jobs and their outcomes, admission, deadlines, stats as plain data.
What the HTTP layer needs of the pipeline (request values, image encoding) it gets from here."""

from server.pipeline import Edit, GenerationRequest
from server.pipeline.clips import frames_for, seconds_of
from server.pipeline.controls import MAX_CONTROLS, Control
from server.pipeline.images import FORMATS, encode_async, to_uint8
from server.pipeline.requests import KINDS, MAX_MODEL_STEPS, SEED_LIMIT
from server.pipeline.stepcache import DEFAULT_INTERVAL, DEFAULT_THRESHOLD, MAX_INTERVAL, parse_step_cache
from server.serving.jobs import Job
from server.serving.limits import Limits
from server.serving.loop import StepLoop
from server.serving.runtime import Runtime
from server.serving.service import Service
from server.serving.stats import Distribution, LoopStats, Snapshot

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_THRESHOLD",
    "FORMATS",
    "KINDS",
    "MAX_CONTROLS",
    "MAX_INTERVAL",
    "MAX_MODEL_STEPS",
    "SEED_LIMIT",
    "Control",
    "Distribution",
    "Edit",
    "GenerationRequest",
    "Job",
    "Limits",
    "LoopStats",
    "Runtime",
    "Service",
    "Snapshot",
    "StepLoop",
    "encode_async",
    "frames_for",
    "parse_step_cache",
    "seconds_of",
    "to_uint8",
]
