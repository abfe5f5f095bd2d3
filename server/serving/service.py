"""What the HTTP layer sees of serving: a `Service` (the loaded model, its step loops, its views;
`runtime.py` holds it through its life). Routes call these and nothing below them: they never
touch the pipeline, the shard or torch.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, Protocol

import torch

from server.errors import InvalidRequest
from server.pipeline import Pipeline
from server.pipeline.loading.folder import closed_vocabulary
from server.requests import GenerationRequest
from server.requests.clip import Clip
from server.requests.generation import size_warning
from server.serving.attached import Attached
from server.serving.housekeeping import IDLE_S, Housekeeper
from server.serving.jobs import INTERACTIVE, PRIORITIES, Job
from server.serving.limits import Limits, check_limits, fit_defaults
from server.serving.loop import StepLoop
from server.serving.stats import DeviceView, LoopStats

log = logging.getLogger("diffshard")

BACKGROUND_STOP_S = 10.0  # for work beside the loops to end at close (a C++ compile it waits on)


class Background(Protocol):
    """Work beside the step loops that gives way to them (a background compile: `GiveWay`)."""

    def serving(self, busy: bool) -> None:
        """The step loops have work (True), or none left (False)."""

    def stop(self, timeout_s: float) -> bool:
        """End now; whether it ended within `timeout_s`."""


class Service:
    """A loaded pipeline behind its step loops, with the service's limits.

    One step loop per lane of the pipeline (`Pipeline.lanes`): one for a model on
    one device or a plain layer split; with replicas or pipelined stages, several, each on its
    own thread with its own requests, so every device has work. A job goes to the lane with the
    fewest rows queued or running; the queue bound is shared out among the lanes.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        name: str,
        limits: Limits | None = None,
        *,
        max_queue: int = 64,
        max_queue_per_key: int | None = None,
        max_background_queue: int | None = None,
        max_batch: int = 16,
        step_budget: float | None = None,
        step_timeout_s: float = 120.0,
        failures_unready: int = 3,
        inject_faults: bool = False,
        tidy: Callable[[], bool] | None = None,
        idle_s: float = IDLE_S,
        threads: int | None = None,
        background: Background | None = None,
        attention: dict[str, Any] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.attention = attention or {}  # the attention backend chosen at startup (/v1/stats)
        self.background, self._serving_lock = background, threading.Lock()
        self.attached = Attached(pipeline)  # adapters and ControlNets, changed at runtime
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.name = name  # the model's id, as clients know it
        self.limits = limits or Limits()
        self.failures_unready = failures_unready
        pipeline.defaults = fit_defaults(pipeline.defaults, self.limits, pipeline.family)
        # A lone request's rows go to idle replicas only with a lane per whole replica, and only
        # where the plan predicts it pays; its decode takes their cores either way.
        whole = len(pipeline.replicas) > 1 and pipeline.lanes_per_replica == 1
        self.splits_lone = pipeline.splits_lone and whole
        self.loops: list[StepLoop] = []
        lanes = pipeline.lanes(self._idle_replicas if whole else None, splits=self.splits_lone)
        # Lanes feeding one replica share its devices' memory, planned for max_batch rows.
        lane_batch = max(2, max_batch // pipeline.lanes_per_replica) if len(lanes) > 1 else max_batch
        lane_budget = (
            step_budget / pipeline.lanes_per_replica if step_budget and len(lanes) > 1 else step_budget
        )
        background_queue = math.ceil(max_background_queue / len(lanes)) if max_background_queue else None
        self.loops = [
            StepLoop(
                lane,
                max_queue=math.ceil(max_queue / len(lanes)),
                max_queue_per_key=math.ceil((max_queue_per_key or max_queue) / len(lanes)),
                max_background_queue=background_queue,
                max_batch=lane_batch,
                step_budget=lane_budget,
                step_timeout_s=step_timeout_s,
                native_pixels=self.limits.native_pixels,
                inject_faults=inject_faults,
                threads=pipeline.lane_threads,
                name="diffshard-loop" if len(lanes) == 1 else f"diffshard-lane-{index}",
            )
            for index, lane in enumerate(lanes)
        ]
        for loop in self.loops:  # each starts idle, as does what runs beside them
            loop.activity.changed = self._activity
        # While every lane is idle, give back what bursts left (the lanes share pool and host).
        self._closing = threading.Event()
        self.housekeeper = None
        if tidy is not None:
            idle = lambda: [loop.activity.idle_since for loop in self.loops]  # noqa: E731
            self.housekeeper = Housekeeper(idle, tidy, self._closing, idle_s)
            self.housekeeper.start()

    def defaults(self) -> dict[str, Any]:
        """What a request naming none gets, in the Images API's names."""
        defaults = self.pipeline.defaults
        return {"num_inference_steps": defaults.steps, "guidance_scale": defaults.guidance_scale}

    def _activity(self) -> None:
        """A lane got work or ran out of it: whether any has work now, said in order."""
        if self.background is not None:
            with self._serving_lock:
                self.background.serving(any(loop.activity.idle_since is None for loop in self.loops))

    def _idle_replicas(self, mine: int) -> Callable[[], list]:
        """Lane `mine`'s view of the others: the shards of the lanes with no job queued or
        running. A lone request's step splits its rows across them (guidance halves, or an n > 1
        request's images)."""
        return lambda: [o.pipeline.shard for i, o in enumerate(self.loops) if i != mine and not o.load()]

    def submit(
        self,
        requests: list[GenerationRequest],
        request_id: str | None = None,
        on_partial: Callable[[int, int, Any], None] | None = None,
        on_progress: Callable[[], None] | None = None,
        owner: str | None = None,
        video: bool = False,
        priority: str = INTERACTIVE,
        timeout_s: float | None = None,
    ) -> Job:
        """Resolve and check the requests (InvalidRequest), then queue them as one job of `owner`
        (Overloaded, KeyOverloaded or Draining when the loop cannot take it). On the step loop's
        thread, `on_partial` receives the partial images the requests ask for, and `on_progress`
        hears each turn that the job moved (`Job.queue_position`, `Job.progress`). A `video`
        job (the video runner's) has a video's deadline, not an image request's; `timeout_s`,
        the caller's own (a batch line's: its batch's completion window), overrides either.
        `priority` is one of PRIORITIES: a background job takes only the room interactive work
        leaves, and waits within bounds of its own."""
        if priority not in PRIORITIES:
            raise InvalidRequest("priority", f"must be {' or '.join(PRIORITIES)}, got {priority!r}")
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise InvalidRequest("timeout_s", f"must be a positive number of seconds, got {timeout_s!r}")
        resolved = self.checked(requests)
        rows = sum(self.pipeline.rows(r) for r in resolved)
        deadline_s, setting = self.limits.deadline(video)
        if timeout_s is not None:
            deadline_s, setting = timeout_s, "the deadline its submitter set"
        job = Job(resolved, rows, deadline_s, owner=owner, timeout_setting=setting, priority=priority)
        job.on_partial, job.on_progress = on_partial, on_progress
        release = self.attached.hold(resolved)  # an adapter or ControlNet unloading: InvalidRequest
        try:
            queued = self._queue(job, request_id)
        except BaseException:
            release()
            raise
        queued.future.add_done_callback(lambda _: release())  # however it ends
        return queued

    def checked(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """The requests resolved, or InvalidRequest: policy first (its message names the setting)."""
        filled = [self.pipeline.with_defaults(r) for r in requests]
        check_limits(filled, self.limits, self.pipeline.family.rows)
        return [self.pipeline.resolve(r) for r in filled]

    @property
    def edits_by_reference(self) -> bool:
        """Whether an edit's images condition the model together (FLUX.2), not start one image each."""
        return self.pipeline.family.edits_by_reference

    @property
    def alpha(self) -> bool:
        """Whether its images carry an alpha channel ([H, W, 4], RGBA: Qwen-Image 2.1), so that
        `background: transparent` can be honoured; the others' are [H, W, 3]."""
        return self.pipeline.family.alpha

    @property
    def clip(self) -> Clip | None:
        """A video model's clip (its default frames, size, frames' rule); None: images only."""
        return self.pipeline.family.clip

    def _queue(self, job: Job, request_id: str | None) -> Job:
        if request_id is not None:  # the loop's log lines name the job: the request's own id
            # ids come from clients: one already in use gets a suffix, so /v1/stats keeps both
            taken = request_id in self.stats().owners
            job.id = f"{request_id}.{secrets.token_hex(3)}" if taken else request_id
        job.warning = size_warning(job.requests[0], self.pipeline.defaults)
        queued = min(self.loops, key=lambda loop: loop.load(job.priority)).submit(job)
        if job.warning is not None:
            log.warning("job %s: %s", job.id, job.warning)
        return queued

    def family(self) -> dict[str, Any]:
        """What /v1/models says of the model: its family, native size, defaults and what it takes."""
        family, defaults = self.pipeline.family, self.pipeline.defaults
        return {
            "name": family.name,
            "native_size": f"{family.native_size}x{family.native_size}",
            "defaults": {
                "num_inference_steps": defaults.steps,
                "guidance_scale": defaults.guidance_scale if family.takes_guidance else None,
                "true_cfg_scale": defaults.true_cfg_scale if family.takes_true_cfg else None,
                "size": f"{defaults.size}x{defaults.size}",
            },
            "supports": {
                "guidance_scale": family.takes_guidance,  # Qwen-Image: true CFG only
                "true_cfg_scale": family.takes_true_cfg,
                "schedulers": list(family.schedulers),
                "step_caches": list(family.step_caches),
                "videos": family.clip is not None,
                "input_reference": (  # image-to-video's first frame
                    "required"
                    if family.takes_reference
                    else "optional"
                    if family.pastes_first_frame
                    else None
                ),
                "experts": list(family.experts),  # Wan 2.2 A14B: two, guidance_scale_2 the second's
                "edits": "by reference" if family.edits_by_reference else "img2img and inpainting",
                "alpha": family.alpha,  # RGBA images: background transparent (and auto in png, webp)
            },
        }

    def vocabulary(self) -> tuple[str, ...] | None:
        """The words the model's closed vocabulary knows (the built-in model's); None if it spells any."""
        return closed_vocabulary(self.pipeline.components.tokenizers)

    @property
    def recommended_steps(self) -> int:
        """The model's own step count (its quality `high`)."""
        return self.pipeline.defaults.steps

    def cancel(self, job: Job) -> None:
        for loop in self.loops:
            loop.cancel(job)  # a no-op in the lanes that do not hold it

    # Views.

    def stats(self) -> LoopStats:
        stats = [loop.stats() for loop in self.loops]
        return sum(stats[1:], start=stats[0])

    def busy(self) -> dict[str, Any]:
        """Per worker (stage or replica): seconds busy, seconds idle while its shard had a forward
        in flight (the pipeline's bubble); and the forwards (micro-batches) in flight now."""
        busy, bubble, in_flight = {}, {}, 0
        for shard in self.pipeline.replicas:
            gates = shard.gates.stats()
            in_flight += gates.in_flight
            for worker, seconds in gates.busy_s.items():
                busy[worker], bubble[worker] = seconds, max(0.0, gates.active_s - seconds)
        return {"busy_seconds": busy, "bubble_seconds": bubble, "micro_batches_in_flight": in_flight}

    @property
    def parallel(self) -> dict[str, Any]:
        """How the lanes use the devices (for /v1/shards)."""
        return {
            "replicas": len(self.pipeline.replicas),
            "stages": len(self.pipeline.shard.plan.stages),
            "lanes": len(self.loops),
            "threads_per_lane": self.pipeline.lane_threads,
            "splits_lone_requests": self.splits_lone,
            "sequence_degree": self.pipeline.deployment.sequence,
            "sequence_every_call": self.pipeline.deployment.grouped,
            "tensor_degree": self.pipeline.deployment.tensor,
            **self.loops[0].pipeline.lane.groups.view(),  # the lanes (and experts) count together
            **({"experts": experts.view()} if len((experts := self.pipeline.expert_steps).names) > 1 else {}),
            "helper_restarts": sum(
                w.restarts
                for loop in self.loops
                for lane in loop.pipeline.expert_lanes
                if (w := lane.workers)
            ),
            **self.busy(),
        }

    def pool(self) -> dict[str, dict[str, Any]]:
        return {
            device: asdict(s) | {"hit_rate": s.hit_rate} for device, s in self.pipeline.pool.stats().items()
        }

    def devices(self) -> dict[str, DeviceView]:
        views: dict[str, DeviceView] = {}
        for deployment in self.pipeline.experts:  # each expert's bytes (Wan 2.2 A14B: two), added
            shared = set()  # an expert's CPU replicas share the "cpu" device and one copy of its weights
            for shard in deployment.replicas:  # replicas on one GPU hold a copy each
                for device, m in shard.memory().items():
                    if device in shared:
                        continue
                    held = views[device].memory.shard_bytes if device in views else 0
                    views[device] = DeviceView(
                        shard.blocks_on(device), replace(m, shard_bytes=m.shard_bytes + held)
                    )
                    shared.update({device} & {"cpu"})
        return views

    def shards(self) -> dict[str, Any]:
        """The plan, each device's blocks and live memory: where every block and byte is."""
        shard = self.pipeline.shard
        return {
            "plan": shard.plan.to_dict(),
            "quantization": self.pipeline.quantization,
            "parallel": self.parallel,
            "devices": {
                device: {"blocks": list(view.blocks), "memory": asdict(view.memory)}
                for device, view in self.devices().items()
            },
            "pool": self.pool(),
            # beside the first stage, counted in its device's other_bytes
            "controlnets": [c | {"device": str(self.pipeline.device)} for c in self.attached.controlnets()],
            "text": str(shard),
        } | ({"tensor_ranks": self.tensor_ranks()} if self.pipeline.deployment.tensor > 1 else {})

    def tensor_ranks(self) -> list[dict[str, Any]]:
        """Each tensor rank's devices and the weight bytes it holds: its share of the split blocks
        and the whole others (CPU ranks share the whole ones, so "cpu"'s device view counts one)."""
        return [
            {"devices": shard.devices, "weight_bytes": sum(shard.param_bytes().values())}
            for shard in self.pipeline.deployment.replicas
        ]

    # Health and lifecycle.

    def problem(self) -> str | None:
        """Why this service should not get traffic: a loop is dead, stuck, slow or on a broken
        device, or its last steps all failed."""
        if problem := self.live_problem():
            return problem
        if slow := next((s for loop in self.loops if (s := loop.slow)), None):
            return slow
        if lost := next((s for loop in self.loops if (s := loop.pipeline.lane.lost)), None):
            return lost
        failures = max(loop.heartbeat.failures_in_a_row for loop in self.loops)
        return f"the last {failures} steps failed" if failures >= self.failures_unready else None

    def live_problem(self) -> str | None:
        """Why the process should be restarted: a step loop is dead, stuck or on a broken device."""
        return next((p for loop in self.loops if (p := loop.problem())), None)

    @property
    def last_step_at(self) -> float | None:
        beats = [b for loop in self.loops if (b := loop.heartbeat.last_beat) is not None]
        return max(beats, default=None)

    def drain(self, timeout_s: float) -> bool:
        """Refuse new jobs; wait up to `timeout_s` for those in flight. True if they all ended."""
        deadline = time.monotonic() + timeout_s
        if self.background is not None:
            self.background.stop(0)  # nothing more is compiled for a server going away; `close` waits
        for loop in self.loops:
            loop.stop_admitting()
        return all(loop.wait_idle(max(0.0, deadline - time.monotonic())) for loop in self.loops)

    def abandon(self, error: Exception) -> None:
        """Answer every queued and running job with `error` now (the process is about to exit)."""
        for loop in self.loops:
            loop.abandon(error)

    def close(self) -> None:
        self._closing.set()
        for loop in self.loops:
            loop.close()
            if loop.pipeline.lane.workers is not None:  # the lane's helper threads go with it
                loop.pipeline.lane.workers.close()
        if self.background is not None and not self.background.stop(BACKGROUND_STOP_S):
            log.warning("the background compile did not stop within %g s", BACKGROUND_STOP_S)
