"""The diffusion pipeline: model families, per-request state, schedulers, loading, images."""

from server.pipeline.denoise import Pipeline
from server.pipeline.requests import Defaults, GenerationRequest
from server.pipeline.state import RequestState, group_states

__all__ = ["Defaults", "GenerationRequest", "Pipeline", "RequestState", "group_states"]
