"""Serving: the step loop, jobs and their outcomes, admission, deadlines, stats as plain data."""

from server.serving.jobs import Job
from server.serving.limits import Limits
from server.serving.loop import StepLoop
from server.serving.runtime import Runtime
from server.serving.service import Service
from server.serving.stats import Distribution, LoopStats, Snapshot

__all__ = ["Distribution", "Job", "Limits", "LoopStats", "Runtime", "Service", "Snapshot", "StepLoop"]
