"""A job is one HTTP request: n images, each its own `RequestState`; it ends exactly once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from server.errors import Cancelled, DeadlineExceeded, OutOfMemory, Rejected, StepFailed
from server.pipeline.steps.state import RequestState
from server.requests.generation import GenerationRequest
from server.serving.health import is_out_of_memory

# Priority classes, the default first. Interactive work is someone waiting on an answer now;
# background work (Batch API lines, requests that ask for it) takes only the room interactive
# work leaves (`Lineup.pick`) and has its own queue bound.
PRIORITIES = ("interactive", "background")
INTERACTIVE, BACKGROUND = PRIORITIES


@dataclass(eq=False)
class Job:
    requests: list[GenerationRequest]  # resolved: every field set
    rows: int  # denoiser rows the job takes at every step
    timeout_s: float  # from arrival (submission): waiting in line and parked count; past it: dropped
    # its images (float [H, W, 3] arrays; [H, W, 4], RGBA, where the family has alpha) or a Rejected
    future: Future = field(default_factory=Future)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    submitted: float = field(default_factory=time.monotonic)
    states: list[RequestState] = field(default_factory=list)
    cancel_requested: bool = False
    owner: str | None = None  # who sent it (an API key's label): the line is fair between owners
    priority: str = INTERACTIVE  # one of PRIORITIES: background work takes only the rows left over
    queue_position: int | None = None  # 1 = the next job of its lane to start; None once running
    # Called on the step loop's thread and must not block: (image index, partial index, [H, W, 3]
    # or RGBA [H, W, 4] image) for each partial image due; and, once a turn, that the job moved.
    on_partial: Callable[[int, int, torch.Tensor], None] | None = None
    on_progress: Callable[[], None] | None = None
    warning: str | None = None  # for the client: a size the model was not trained at
    timeout_setting: str = "DIFFSHARD_REQUEST_TIMEOUT_S"  # what sets `timeout_s` (said past it)

    @property
    def pixel_rows(self) -> int:
        """The work of its step: each request's rows × its image's pixels (× a video's latent frames)."""
        per_request = self.rows // max(1, len(self.requests))
        return sum(per_request * r.width * r.height * r.latent_frames for r in self.requests)

    @property
    def deterministic(self) -> bool:
        """Its calls run alone, so its bytes do not depend on what else is batched."""
        return any(r.deterministic for r in self.requests)

    @property
    def deadline(self) -> float:
        """The time.monotonic() past which the job is dropped, wherever it is: waiting, parked
        (admitted but given no row this step) or stepping; counted from its arrival."""
        return self.submitted + self.timeout_s

    def cancel(self) -> None:
        """Drop the job at the next step boundary (the client went away)."""
        self.cancel_requested = True

    def report(self) -> None:
        """Hand over the partial images due at this step, and say the job moved."""
        for index, state in enumerate(self.states):
            if state.preview is not None and self.on_partial is not None:
                self.on_partial(index, *state.preview)
            state.preview = None
        if self.on_progress is not None:
            self.on_progress()

    def progress(self) -> list[tuple[int, int]]:
        """(steps done, steps in all) per image."""
        if not self.states:
            return [(0, r.steps) for r in self.requests]
        return [(s.index, s.steps) for s in self.states]


def place_in_line(queue: Iterable[Job]) -> None:
    """Number the waiting jobs from 1, and tell those whose place changed."""
    for position, job in enumerate(queue, start=1):
        if job.queue_position != position:
            job.queue_position = position
            if job.on_progress is not None:
                job.on_progress()


def leaving_outcome(job: Job) -> Rejected:
    """How a job that leaves before its images are done ends: its client went, or its deadline."""
    if job.cancel_requested:
        return Cancelled("the client disconnected")
    return DeadlineExceeded(f"the request ran past its deadline: {job.timeout_s:g} s ({job.timeout_setting})")


def failure_outcome(err: Exception) -> Rejected:
    """How a job whose call raised ends; no torch text (on CUDA it names capacity and other processes)."""
    if is_out_of_memory(err):
        return OutOfMemory("out of device memory during generation")
    if isinstance(err, Rejected):  # said in our words already (a helper thread lost: 503)
        return err
    return StepFailed(f"generation failed: {type(err).__name__}")
