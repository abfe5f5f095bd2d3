"""The service loop in process, on tiny random SD-1.5- and SDXL-shaped folders: requests that
ran batched give the image they give alone, whatever they share a step with."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from server.errors import DeadlineExceeded, Draining, NotReady, Overloaded
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.serving import Limits, Service
from tests.support.waiting import wait_until

TOLERANCE = 1e-3
LIMITS = Limits(max_steps=1000, request_timeout_s=60)

MIXED = [  # steps, guidance, seeds, sizes and schedulers all differ
    [GenerationRequest("a red circle", seed=1, steps=6, guidance_scale=4.0, scheduler="euler_a")],
    [GenerationRequest("a blue square", seed=2, steps=4, guidance_scale=1.0, scheduler="dpmpp_2m")],
    [
        GenerationRequest("a green star", "red", seed=3, steps=5, guidance_scale=7.5, scheduler="ddim"),
        GenerationRequest("a green star", "red", seed=4, steps=5, guidance_scale=7.5, scheduler="ddim"),
    ],
    [GenerationRequest("a white circle", seed=5, steps=3, scheduler="euler", width=48, height=24)],
    [GenerationRequest("a purple square", seed=6, steps=7, guidance_scale=2.0, width=48, height=24)],
]


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_batched_requests_give_the_images_they_give_alone(folders: dict[str, Path], kind: str) -> None:
    pipeline = Pipeline.load(folders[kind], devices="cpu")
    alone = [pipeline.generate(requests) for requests in MIXED]
    service = Service(pipeline, "tiny", LIMITS, max_batch=16)
    joined, step = threading.Event(), pipeline.step

    def step_then_hold(states) -> None:  # the loop waits at the first job's step 2 for the others
        step(states)
        if not joined.is_set() and any(state.index >= 2 for state in states):
            joined.wait(timeout=60)

    pipeline.step = step_then_hold  # the 6-step first job would otherwise be done between two polls
    try:
        first = service.submit(MIXED[0])
        wait_until(  # the others join late
            lambda: service.stats().progress.get(first.id, [(0, 0)])[0][0] >= 2,
            60,
            "the first job at its step 2",
        )
        jobs = [first] + [service.submit(requests) for requests in MIXED[1:]]
        joined.set()
        together = [job.future.result(timeout=60) for job in jobs]
        stats = service.stats()
    finally:
        joined.set()
        service.close()
    for solo, batched in zip(alone, together, strict=True):
        for a, b in zip(solo, batched, strict=True):
            assert np.abs(a - b).max() < TOLERANCE
    assert max(stats.batch_rows) > 2  # requests really shared UNet calls
    assert stats.jobs_completed == len(MIXED) and stats.images_completed == 6
    assert pipeline.pool.stats()["cpu"].bytes_in_use == 0


def test_a_job_larger_than_a_batch_runs_alone_in_several_calls(folders: dict[str, Path]) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    requests = [  # DDIM: a call a step (the folder's PNDM takes its first timestep twice)
        GenerationRequest("a red circle", seed=s, steps=2, guidance_scale=3.0, scheduler="ddim")
        for s in range(3)
    ]
    service = Service(pipeline, "tiny", LIMITS, max_batch=4)  # 6 rows: calls of 4 and 2
    try:
        images = service.submit(requests).future.result(timeout=60)
        stats = service.stats()
    finally:
        service.close()
    assert len(images) == 3 and dict(stats.batch_rows) == {4: 2, 2: 2}


def test_a_full_queue_refuses_with_retry_after(folders: dict[str, Path]) -> None:
    service = Service(Pipeline.load(folders["sd15"], devices="cpu"), "tiny", LIMITS, max_queue=0)
    try:
        with pytest.raises(Overloaded) as caught:
            service.submit([GenerationRequest("a red circle", steps=2)])
    finally:
        service.close()
    assert 1 <= caught.value.retry_after <= 120
    assert service.stats().rejected["queue_full"] == 1


def test_closing_ends_running_and_queued_jobs_and_returns_their_buffers(folders: dict[str, Path]) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    service = Service(
        pipeline, "tiny", LIMITS, max_batch=2
    )  # one guided image at a time: the second job waits
    running = service.submit([GenerationRequest("a red circle", steps=500)])
    queued = service.submit([GenerationRequest("a blue square", steps=500)])
    wait_until(
        lambda: service.stats().progress.get(running.id, [(0, 0)])[0][0] >= 1,
        60,
        "the running job's first step",
    )
    service.close()
    for job in (running, queued):
        assert isinstance(job.future.exception(timeout=60), Draining)
    assert pipeline.pool.stats()["cpu"].bytes_in_use == 0
    assert service.stats().rejected["draining"] == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's death
def test_a_killed_loop_answers_every_waiting_request_at_once(folders: dict[str, Path]) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    service = Service(pipeline, "tiny", LIMITS, max_batch=2, inject_faults=True)  # one guided image at a time
    killer = service.submit([GenerationRequest("a red circle [[kill]]", steps=5)])
    waiting = [service.submit([GenerationRequest("a blue square", steps=5)]) for _ in range(3)]
    for job in [killer, *waiting]:
        assert isinstance(job.future.exception(timeout=30), NotReady)
    assert "stopped" in wait_until(service.problem, 5, "the loop thread's end")
    with pytest.raises(NotReady, match="step loop stopped"):  # and nothing new is queued to wait forever
        service.submit([GenerationRequest("a red circle", steps=2)])


def test_a_wedged_step_is_seen_and_its_waiting_requests_are_answered(folders: dict[str, Path]) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    service = Service(pipeline, "tiny", LIMITS, max_batch=2, step_timeout_s=0.5, inject_faults=True)
    try:
        wedged = service.submit([GenerationRequest("a red circle [[hang]]", steps=5)])
        waiting = service.submit([GenerationRequest("a blue square", steps=5)])
        for job in (wedged, waiting):  # the watchdog answers both while the step still hangs
            assert isinstance(job.future.exception(timeout=30), NotReady)
        assert "stuck" in service.problem()
        assert service.loops[0].heartbeat.running_for() > 0.5
    finally:
        service.close()  # releases the hang


def test_a_poisoned_request_fails_alone_and_the_batch_it_shared_goes_on(folders: dict[str, Path]) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    service = Service(pipeline, "tiny", LIMITS, inject_faults=True)
    try:
        jobs = [service.submit([GenerationRequest(p, seed=i, steps=4)]) for i, p in enumerate(PROMPTS)]
        outcomes = [job.future.exception(timeout=60) for job in jobs]
    finally:
        service.close()
    assert [type(o).__name__ for o in outcomes] == ["NoneType", "StepFailed", "NoneType", "NoneType"]
    assert pipeline.pool.stats()["cpu"].bytes_in_use == 0


PROMPTS = ["a red circle", "a blue square [[fail]]", "a green triangle", "a white circle"]


def test_defaults_beyond_the_limits_are_lowered_to_them(folders: dict[str, Path]) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    service = Service(pipeline, "tiny", Limits(max_steps=4, max_pixels=16 * 16))
    try:
        job = service.submit([GenerationRequest("a red circle")])  # the folder's default: 50 steps, 32x32
        image = job.future.result(timeout=60)[0]
    finally:
        service.close()
    assert (job.requests[0].steps, job.requests[0].width, image.shape) == (4, 16, (16, 16, 3))


def test_idle_housekeeping_runs_off_the_loop_s_lock_until_nothing_idle_is_left(
    folders: dict[str, Path],
) -> None:
    """While every lane is idle, `tidy` runs on its own thread every idle_s until it says the
    floor is reached; meanwhile the loop takes and serves work as usual."""
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    held, release, floor = threading.Event(), threading.Event(), threading.Event()
    calls: list[int] = []

    def idle_bytes() -> int:
        return sum(s.bytes_idle for s in pipeline.pool.stats().values())

    def tidy() -> bool:
        calls.append(idle_bytes())
        if len(calls) == 1:  # the first housekeeping holds on until the test has used the loop
            held.set()
            release.wait(30)
        pipeline.pool.trim(idle_for_s=0)
        if idle_bytes() == 0:
            floor.set()
        return idle_bytes() == 0

    service = Service(pipeline, "tiny", LIMITS, tidy=tidy, idle_s=0.05)
    try:
        for side in (16, 24, 32):  # a small burst of distinct sizes leaves idle buffers behind
            request = GenerationRequest("a red circle", steps=2, width=side, height=side)
            service.submit([request]).future.result(timeout=60)
        assert held.wait(30), "no housekeeping while idle"
        assert calls[0] > 0  # the burst's buffers were pooled
        during = service.submit([GenerationRequest("a blue square", steps=2)])  # not blocked by it
        assert len(during.future.result(timeout=60)) == 1 and service.stats().jobs_completed == 4
        release.set()
        assert floor.wait(30), f"the pool never emptied: {calls}"
        assert idle_bytes() == 0
    finally:
        release.set()
        service.close()


def test_housekeeping_tidies_again_after_a_burst_it_never_saw_busy() -> None:
    """A burst that starts and ends between two of its wake-ups still moves the lanes' idle
    times: once at the floor, the housekeeper tidies again after it (it used to wait for a lane
    it saw busy, and a short burst after the floor left its memory behind for good)."""
    from server.serving.housekeeping import Housekeeper

    long_ago = time.monotonic() - 60
    since, tidied, stop = [long_ago, long_ago], [threading.Event(), threading.Event()], threading.Event()

    def tidy() -> bool:
        next(e for e in tidied if not e.is_set()).set()
        return True  # the floor, every time

    keeper = Housekeeper(lambda: since, tidy, stop, every_s=0.01)
    keeper.start()
    try:
        assert tidied[0].wait(10)
        assert not tidied[1].wait(0.2)  # at the floor: nothing more while nothing happens
        since[1] = long_ago + 30  # lane 1 served a burst and went idle again, unseen
        assert tidied[1].wait(10), "no housekeeping after the burst"
    finally:
        stop.set()
        keeper.join(10)


def test_jobs_the_watchdog_answered_are_dropped_not_computed_and_the_loop_recovers(
    folders: dict[str, Path],
) -> None:
    """A step held far past its deadline: the watchdog calls the loop stuck and answers both
    jobs 503; once the step returns, neither is stepped again, and the loop serves anew."""
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    step, entered, release = pipeline.step, threading.Event(), threading.Event()
    after_release: list[int] = []

    def held_step(states) -> None:
        if release.is_set():
            after_release.append(len(states))
        elif not entered.is_set():
            entered.set()
            release.wait(30)  # the first step hangs until the test lets it go
        step(states)

    pipeline.step = held_step
    service = Service(pipeline, "tiny", LIMITS, max_batch=4, step_timeout_s=0.05)
    try:
        jobs = [service.submit([GenerationRequest(p, seed=i, steps=5)]) for i, p in enumerate(PROMPTS[:2])]
        assert entered.wait(30)
        for job in jobs:
            assert isinstance(job.future.exception(timeout=30), NotReady)
        assert "stuck" in service.live_problem()
        release.set()
        wait_until(lambda: service.problem() is None, 30, "the loop recovering once the step returned")
        assert service.loops[0].wait_idle(30)
        assert after_release == []  # the answered jobs were dropped, not stepped
        fresh = service.submit([GenerationRequest("a white circle", seed=9, steps=3)])
        assert len(fresh.future.result(timeout=60)) == 1
    finally:
        release.set()
        service.close()


def test_a_parked_job_keeps_its_deadline_from_arrival_and_is_dropped_past_it(
    folders: dict[str, Path],
) -> None:
    """Two keys, one guided image each, and a step of 2 rows: the keys take the step in turn, so
    each job is parked every other step. The deadline counts from arrival, time parked included:
    once the parked job's has passed, it ends 504 at the next step boundary without another step,
    and the other key's job finishes."""
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    step, stepped, late = pipeline.step, [], {}

    def watched(states) -> None:
        prompt = states[0].request.prompt
        parked = jobs[1] if len(jobs) == 2 and jobs[1].states and prompt == "a red circle" else None
        if parked is not None and not late:
            parked.submitted -= 3600  # as if it had arrived an hour ago, while it is parked
            late["at"] = len(stepped)
        stepped.append(prompt)
        step(states)

    pipeline.step = watched
    service = Service(pipeline, "tiny", LIMITS, max_batch=2)
    jobs = []
    try:
        jobs.append(service.submit([GenerationRequest("a red circle", seed=1, steps=8)], owner="a"))
        wait_until(
            lambda: service.stats().progress.get(jobs[0].id, [(0, 0)])[0][0] >= 1, 60, "a's first step"
        )
        jobs.append(service.submit([GenerationRequest("a blue square", seed=2, steps=8)], owner="b"))
        assert len(jobs[0].future.result(timeout=60)) == 1
        assert isinstance(jobs[1].future.exception(timeout=60), DeadlineExceeded)
    finally:
        service.close()
    assert "at" in late and "a blue square" in stepped[: late["at"]]  # it ran, then was parked
    assert "a blue square" not in stepped[late["at"] :]  # and never stepped past its deadline
    assert pipeline.pool.stats()["cpu"].bytes_in_use == 0
