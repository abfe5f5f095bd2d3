"""The thread that owns the pipeline: a ModelShard runs one forward at a time, so every
generation runs on this one thread, in arrival order, and the event loop only awaits it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from server.pipeline.denoise import GenerationRequest, Pipeline


class Worker:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffshard-engine")

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[np.ndarray]:
        """The images of `requests`, made together (one batched UNet call per step)."""
        return await asyncio.wrap_future(self._thread.submit(self.pipeline.generate, requests))

    def close(self) -> None:
        """Finish the generation in flight; drop those not started."""
        self._thread.shutdown(wait=True, cancel_futures=True)
