"""The diffusion pipeline: model families, per-request state, schedulers, loading, images.
What the serving layer reads of the engine (memory and pool numbers) it gets from here."""

from server.engine import DeviceMemory
from server.engine.hardware.threads import take_thread
from server.engine.runtime.graphs import CompileStats
from server.engine.runtime.pool import PoolStats
from server.engine.runtime.tracing import trace_gate
from server.pipeline.denoise import Pipeline
from server.pipeline.edits import Edit
from server.pipeline.requests import Defaults, GenerationRequest, size_warning
from server.pipeline.state import RequestState, group_states

__all__ = [
    "CompileStats",
    "Defaults",
    "DeviceMemory",
    "Edit",
    "GenerationRequest",
    "Pipeline",
    "PoolStats",
    "RequestState",
    "group_states",
    "size_warning",
    "take_thread",
    "trace_gate",
]
