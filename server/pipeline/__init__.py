"""The diffusion pipeline: a model family's encoders and VAE around a sharded denoiser, run
request by request or many at once. Its rooms: `families/` (what differs per model), `steps/`
(a step of many requests), `conditioning/` (LoRA, ControlNets, edits) and `loading/` (a folder
read, planned, placed and compiled)."""

from server.pipeline.pipeline import Pipeline

__all__ = ["Pipeline"]
