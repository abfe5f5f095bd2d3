"""Priority classes (issue 73): interactive work takes its rows first, background work only the
room it leaves, in time as well as rows. `Lineup.pick` as plain values against measured call
costs shaped as a CPU's (every row costs) and a GPU's (rows under the knee free), and a run of
many turns; then the built-in model in process (a background job parked when interactive work
arrives keeps its state and makes the image it makes alone; its own queue bound; its caller's
deadline); then over HTTP (the image an interactive request makes, a bad value's 400, /v1/stats
by class)."""

from __future__ import annotations

import base64
import threading
from collections import Counter
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from server.errors import DeadlineExceeded, InvalidRequest, Overloaded
from server.pipeline import Pipeline
from server.requests import GenerationRequest
from server.serving import Limits, Service
from server.serving.jobs import BACKGROUND, INTERACTIVE, Job
from server.serving.lineup import Lineup, Room
from server.serving.stepcosts import SAMPLES, WINDOW, StepCosts
from tests.support.live import LiveServer
from tests.support.waiting import wait_until

SIDE = 64
ROWS = range(2, 17, 2)  # the calls measured: one to eight guided images
# Seconds of a call of n rows, in the shapes measured: the built-in model on a 2-core CPU
# (c(n) ~ c0 + k n, c0 ~ 0.74 c(2)), and a GPU flat up to a knee at 12 rows.
CPU: Callable[[int], float] = lambda rows: 0.74 + 0.13 * rows  # noqa: E731
GPU: Callable[[int], float] = lambda rows: 1.0 + 0.1 * max(0, rows - 12)  # noqa: E731
LIMITS = Limits(max_steps=1000, request_timeout_s=60)


def sized(owner: str | None, priority: str = INTERACTIVE, rows: int = 2) -> Job:
    request = GenerationRequest("a", width=SIDE, height=SIDE)
    return Job([request], rows, 60.0, owner=owner, priority=priority)


def measured(seconds: Callable[[int], float]) -> StepCosts:
    """A loop's costs after timing calls of every row count in ROWS, SAMPLES times each."""
    costs = StepCosts()
    for _ in range(SAMPLES):
        for rows in ROWS:
            costs.observe(rows * SIDE * SIDE, seconds(rows))
    return costs


def line_of(*jobs: Job) -> Lineup:
    lineup = Lineup()
    for queued in jobs:
        lineup.append(queued)
    return lineup


def rows(jobs: list[Job], priority: str) -> int:
    return sum(j.rows for j in jobs if j.priority == priority)


def test_a_cost_is_read_off_the_measured_calls_and_nothing_is_guessed_beyond_them() -> None:
    costs = StepCosts()
    for _ in range(SAMPLES):
        costs.observe(2 * SIDE * SIDE, 1.0)
    assert costs.seconds(2 * SIDE * SIDE) is None  # one work measured: no slope to go on
    for _ in range(SAMPLES - 1):
        costs.observe(8 * SIDE * SIDE, 2.0)
    assert costs.seconds(4 * SIDE * SIDE) is None  # a work counts once called SAMPLES times
    costs.observe(8 * SIDE * SIDE, 2.0)
    costs.observe(8 * SIDE * SIDE, 9.0)  # one slow call (the HTTP side busy) moves no median
    assert costs.seconds(4 * SIDE * SIDE) == pytest.approx(1 + 1 / 3)  # between the two
    assert costs.seconds(10 * SIDE * SIDE) is None  # larger than any call timed: not guessed
    for _ in range(SAMPLES):
        costs.observe(4 * SIDE * SIDE, 3.0)  # a few slow small calls (run eagerly, say)...
    assert costs.seconds(8 * SIDE * SIDE) == pytest.approx((5 * 3.0 + 6 * 2.0) / 11)  # ...pooled, not the max
    gpu = measured(GPU)
    assert gpu.seconds(10 * SIDE * SIDE) == pytest.approx(1.0)  # under the knee: as one row
    assert gpu.seconds(16 * SIDE * SIDE) == pytest.approx(1.4)
    for _ in range(WINDOW):
        gpu.observe(12 * SIDE * SIDE, 1.0)
    assert gpu.seconds(12 * SIDE * SIDE) is None  # the others left the window: timed again, not remembered


def test_interactive_jobs_take_their_rows_first_and_background_jobs_only_the_time_they_leave() -> None:
    def pick(room: Room) -> list[Job]:
        batch = [sized("batch", BACKGROUND) for _ in range(10)]
        interactive = [sized("a"), sized("b")]
        return line_of(*batch, *interactive).pick([], max_rows=16, room=room)[1]

    on_gpu = pick(Room(measured(GPU), calm=False))
    assert [j.priority for j in on_gpu[:2]] == [INTERACTIVE] * 2  # the line's later arrivals first
    assert rows(on_gpu, BACKGROUND) == 8  # up to the knee: 12 rows cost what 4 do
    on_cpu = pick(Room(measured(CPU), calm=False))
    assert rows(on_cpu, INTERACTIVE) == 4 and rows(on_cpu, BACKGROUND) == 0  # 2 more rows: +15%
    assert rows(pick(Room(None, calm=True)), BACKGROUND) == 0  # nothing measured: no guess


def test_without_interactive_work_background_steps_are_held_short_until_it_has_been_away_a_while() -> None:
    def pick(room: Room) -> list[Job]:
        return line_of(*[sized("batch", BACKGROUND) for _ in range(10)]).pick([], max_rows=16, room=room)[1]

    assert len(pick(Room(measured(CPU), calm=False))) == 1  # a request arriving mid-call waits one 2-row call
    assert len(pick(Room(None, calm=False))) == 1  # its first job runs, measured or not
    assert len(pick(Room(measured(GPU), calm=False))) == 6  # as short as one job's call: 12 rows
    assert len(pick(Room(measured(CPU), calm=True))) == 8  # nobody to slow: the whole step
    assert len(pick(Room(None, calm=True))) == 8


def test_a_background_job_admitted_then_parked_for_interactive_work_goes_on_after_it() -> None:
    costs = measured(CPU)
    batch = sized("batch", BACKGROUND)
    lineup = line_of(batch)
    assert lineup.pick([], max_rows=16, room=Room(costs, calm=True)) == ([], [batch])
    interactive = sized("a")
    lineup.append(interactive)
    run, admitted = lineup.pick([batch], max_rows=16, room=Room(costs, calm=False))
    assert run == [] and admitted == [interactive]  # parked: still admitted, given no row
    assert lineup.pick([batch, interactive], max_rows=16, room=Room(costs, calm=False)) == ([interactive], [])
    assert lineup.pick([batch], max_rows=16, room=Room(costs, calm=False)) == ([batch], [])  # it goes on


def test_background_owners_share_their_rows_evenly_and_apart_from_their_interactive_share() -> None:
    """Deficit round robin within the class: 4-row jobs against 2-row jobs, both keys backlogged,
    whole steps of 6 rows; and a key's background work costs nothing of its interactive rows."""
    lineup = line_of(
        *[sized("big", BACKGROUND, 4) for _ in range(20)], *[sized("small", BACKGROUND) for _ in range(20)]
    )
    active: list[Job] = []
    taken: Counter[str | None] = Counter()
    for _ in range(12):
        run, admitted = lineup.pick(active, max_rows=6, room=Room(None, calm=True))
        active = [*active, *admitted]
        assert sum(j.rows for j in run + admitted) == 6  # every row, every step
        for j in run + admitted:
            taken[j.owner] += j.rows
    assert abs(taken["big"] - taken["small"]) <= 4, taken
    both = line_of(
        *[sized("a", BACKGROUND) for _ in range(8)],
        *[sized("a") for _ in range(4)],
        *[sized("b") for _ in range(4)],
    )
    admitted = both.pick([], max_rows=8, room=Room(measured(GPU), calm=False))[1]
    interactive = Counter(j.owner for j in admitted if j.priority == INTERACTIVE)
    assert interactive == {"a": 2, "b": 2}


def test_background_work_waits_out_interactive_load_on_a_cpu_and_then_takes_whole_steps() -> None:
    """Two clients send a 2-row job each as soon as their last is done, for 40 turns, beside 40
    background jobs queued at once (each job: 5 steps). On a CPU's costs no background row joins
    an interactive step; once the clients stop, background steps are short for a job's time,
    then whole, and every background job is done."""
    steps, costs = 5, measured(CPU)
    lineup = line_of(*[sized("batch", BACKGROUND) for _ in range(40)])
    active: list[Job] = []
    progress: Counter[str] = Counter()
    clients: dict[str, Job | None] = {"a": None, "b": None}
    done: list[Job] = []
    seen, turn, taken = -1, 0, []
    while turn < 40 or lineup or active:
        for client, job in clients.items():
            if turn < 40 and job is None:
                clients[client] = sized(client)
                lineup.append(clients[client])
        if any(clients.values()):
            seen = turn
        run, admitted = lineup.pick(active, max_rows=16, room=Room(costs, calm=turn - seen > steps))
        active += admitted
        taken.append((rows(run + admitted, INTERACTIVE), rows(run + admitted, BACKGROUND)))
        for stepped in run + admitted:
            progress[stepped.id] += 1
            if progress[stepped.id] == steps:
                active.remove(stepped)
                done.append(stepped)
                if stepped.owner in clients:
                    clients[stepped.owner] = None
        turn += 1
        assert turn < 200, "background work starved"
    assert sum(j.priority == BACKGROUND for j in done) == 40
    assert all(background == 0 for interactive, background in taken if interactive)
    last = max(turn for turn, (interactive, _) in enumerate(taken) if interactive)
    held = [background for _, background in taken[last + 1 : last + 1 + steps]]
    assert held == [2] * steps  # a job at a time while interactive work may come back
    assert taken[last + 1 + steps][1] == 16  # then whole steps


def guarded(service: Service, hold_at: int) -> tuple[threading.Event, list[list[str]]]:
    """Each denoiser call's prompts, and a hold at the first call with a row at its step
    `hold_at`, until the event is set (so a second job arrives mid-way, not after)."""
    (loop,) = service.loops
    pipeline = loop.pipeline  # the lane's view of the pipeline: what the loop calls
    go, calls, step = threading.Event(), [], pipeline.step

    def recorded(states) -> None:
        calls.append([s.request.prompt for s in states])
        step(states)
        if any(s.index >= hold_at for s in states):
            go.wait(timeout=60)

    pipeline.step = recorded
    return go, calls


def test_a_background_job_parked_by_interactive_work_keeps_its_state_and_makes_the_image_it_makes_alone() -> (
    None
):
    pipeline = Pipeline.load(devices="cpu")
    later = GenerationRequest("a blue square", seed=3, steps=8)
    alone = pipeline.generate([later])[0]
    service = Service(pipeline, "shapes", LIMITS)
    go, calls = guarded(service, hold_at=3)
    try:
        batch = service.submit([later], priority=BACKGROUND)
        wait_until(
            lambda: service.stats().progress.get(batch.id, [(0, 0)])[0][0] >= 3, 60, "the batch job's step 3"
        )
        interactive = service.submit([GenerationRequest("a red circle", seed=1, steps=4)])
        go.set()
        image = batch.future.result(timeout=120)[0]
        assert interactive.future.done()  # it went first
        stats = service.stats()
    finally:
        go.set()
        service.close()
    assert np.abs(image - alone).max() < 1e-3
    first = next(i for i, call in enumerate(calls) if "a red circle" in call)
    last = max(i for i, call in enumerate(calls) if "a red circle" in call)
    assert all("a blue square" not in call for call in calls[first : last + 1])  # parked meanwhile
    assert any("a blue square" in call for call in calls[last + 1 :])  # then it went on
    assert stats.rows_by_priority[BACKGROUND] == 2 * sum(call.count("a blue square") for call in calls)
    assert stats.rows_by_priority[INTERACTIVE] == 2 * sum(call.count("a red circle") for call in calls)


def test_background_jobs_wait_within_bounds_of_their_own_and_by_their_callers_deadline() -> None:
    pipeline = Pipeline.load(devices="cpu")
    service = Service(pipeline, "shapes", LIMITS, max_queue=1, max_background_queue=2, max_batch=2)
    go, _ = guarded(service, hold_at=1)
    shape = [GenerationRequest("a red circle", seed=1, steps=2)]
    try:
        running = service.submit(shape)
        wait_until(lambda: service.stats().active_jobs == 1, 60, "the first job admitted")
        service.submit(shape)  # the interactive line's one place
        with pytest.raises(Overloaded):
            service.submit(shape)
        late = service.submit(shape, priority=BACKGROUND, timeout_s=0.05)  # past it before a row is free
        service.submit(shape, priority=BACKGROUND)
        with pytest.raises(Overloaded):
            service.submit(shape, priority=BACKGROUND)
        assert service.stats().queue_depth_by_priority == {INTERACTIVE: 1, BACKGROUND: 2}
        with pytest.raises(InvalidRequest) as bad:
            service.submit(shape, priority="urgent")
        assert bad.value.field == "priority" and "interactive or background" in str(bad.value)
        with pytest.raises(InvalidRequest, match=r"^timeout_s: "):
            service.submit(shape, priority=BACKGROUND, timeout_s=0)
        go.set()
        with pytest.raises(DeadlineExceeded, match=r"0\.05 s \(the deadline its submitter set\)"):
            late.future.result(timeout=60)
        running.future.result(timeout=60)
    finally:
        go.set()
        service.close()


BODY = {"prompt": "a red circle", "seed": 7, "num_inference_steps": 4, "deterministic": True}


def engine(server: LiveServer) -> dict:
    return httpx.get(f"{server.url}/v1/stats", timeout=30).json()["engine"]


def test_a_background_request_makes_the_image_an_interactive_one_makes_and_stats_count_its_rows(
    server: LiveServer,
) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        before = engine(server)["priorities"]
        answers = [
            client.post("/v1/images/generations", json=BODY | {"priority": priority})
            for priority in (INTERACTIVE, BACKGROUND)
        ]
        after = engine(server)["priorities"]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    interactive, background = (base64.b64decode(a.json()["data"][0]["b64_json"]) for a in answers)
    assert background == interactive
    assert set(after) == {INTERACTIVE, BACKGROUND}
    assert set(after[BACKGROUND]) == {"queue_depth", "active_rows", "rows_total"}
    stepped = {p: after[p]["rows_total"] - before[p]["rows_total"] for p in after}
    assert stepped[BACKGROUND] == stepped[INTERACTIVE] > 0  # the same calls, counted by class


@pytest.mark.parametrize("priority", ["urgent", 1, None])
def test_a_bad_priority_is_refused_naming_the_field(server: LiveServer, priority: object) -> None:
    answer = httpx.post(f"{server.url}/v1/images/generations", json=BODY | {"priority": priority}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "priority" and error["message"].startswith("priority: "), error
