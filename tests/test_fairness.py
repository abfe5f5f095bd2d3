"""Fairness between API keys (issues 22, 37): the line's order and deficit round robin
(`Lineup`, as plain values, and a pure-Python run of many steps: every row taken while any key
has work, a lone key ahead of a flood), then through the real server: three floods do not hold
back another key's request, and /v1/stats shows each key only its own jobs."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server.requests import GenerationRequest
from server.serving.jobs import Job
from server.serving.lineup import Lineup
from tests.support.live import LiveServer, live_server
from tests.support.waiting import wait_until


def job(owner: str | None, rows: int = 2) -> Job:
    return Job([GenerationRequest("a")], rows, 60.0, owner=owner)


def sized(side: int, rows: int = 2) -> Job:
    return Job([GenerationRequest("a", width=side, height=side)], rows, 60.0)


def line_of(*jobs: Job) -> Lineup:
    lineup = Lineup()
    for queued in jobs:
        lineup.append(queued)
    return lineup


def rows(*groups: list[Job]) -> int:
    return sum(j.rows for group in groups for j in group)


def test_owners_take_turns_in_the_line_and_are_numbered_so() -> None:
    a1, a2, a3, b1, b2 = job("a"), job("a"), job("a"), job("b"), job("b")
    lineup = line_of(a1, a2, a3, b1, b2)
    assert list(lineup) == [a1, b1, a2, b2, a3]
    assert [j.queue_position for j in (a1, b1, a2, b2, a3)] == [1, 2, 3, 4, 5]
    run, admitted = lineup.pick([], max_rows=4)
    assert run == [] and admitted == [a1, b1]  # one each, not the first two to arrive
    assert list(lineup) == [b2, a2, a3]  # turns rotate: b goes first next time


def test_a_lone_owner_fills_every_row_and_a_job_too_big_runs_alone() -> None:
    jobs = [job("a") for _ in range(10)]
    assert line_of(*jobs).pick([], max_rows=16) == ([], jobs[:8])
    big, small = job("a", rows=40), job("b")
    lineup = line_of(big, small)
    assert lineup.pick([], max_rows=16) == ([], [small])  # big must earn 2.5 steps' credit first
    turns = 1
    while (picked := lineup.pick([small], max_rows=16)) == ([small], []):
        turns += 1
    assert picked == ([], [big]) and turns <= 5  # then it runs alone; small is parked meanwhile


def test_three_keys_with_two_row_jobs_fill_every_row() -> None:
    """The issue's case: an equal share each (16 / 3 rows) left 4 of 16 rows idle."""
    floods = {key: [job(key) for _ in range(6)] for key in "abc"}
    lineup = line_of(*[j for flood in zip(*floods.values(), strict=True) for j in flood])
    run, admitted = lineup.pick([], max_rows=16)
    assert run == [] and rows(admitted) == 16
    assert sorted(Counter(j.owner for j in admitted).values()) == [2, 3, 3]  # as even as rows allow
    run, more = lineup.pick(admitted, max_rows=16)
    assert rows(run, more) == 16 and sorted(Counter(j.owner for j in run + more).values()) == [2, 3, 3]


def test_a_lone_key_joins_a_full_step_and_the_flood_keeps_the_other_rows() -> None:
    flood = [job("a") for _ in range(8)]  # 16 rows: every row of the step
    lone = job("b")
    run, admitted = line_of(lone).pick(flood, max_rows=16)
    assert admitted == [lone]
    assert run == flood[:7]  # the flood keeps its earliest seven: only one is parked
    run, admitted = Lineup().pick(flood, max_rows=16)  # the other owner gone: all of them again
    assert run == flood and admitted == []


def test_owners_of_big_and_small_jobs_get_equal_rows_over_steps() -> None:
    """Deficit round robin: 4-row jobs against 2-row jobs, both keys backlogged; 6 rows a step
    cannot split evenly every step, so credit carries the difference to the next."""
    lineup = line_of(*[job("big", rows=4) for _ in range(20)], *[job("small") for _ in range(20)])
    active: list[Job] = []
    taken: Counter[str | None] = Counter()
    for _ in range(12):
        run, admitted = lineup.pick(active, max_rows=6)
        active = [*active, *admitted]
        assert rows(run, admitted) == 6  # every row, every step
        for j in run + admitted:
            taken[j.owner] += j.rows
    assert abs(taken["big"] - taken["small"]) <= 4, taken


def test_jobs_without_an_owner_share_one_line_first_come_first_served() -> None:
    jobs = [job(None) for _ in range(5)]
    lineup = line_of(*jobs)
    assert list(lineup) == jobs
    assert lineup.pick([], max_rows=6)[1] == jobs[:3]


def simulate(
    arrivals: dict[int, list[Job]], steps: int, max_rows: int = 16
) -> tuple[dict[str, int], list[tuple[int, int]]]:
    """Step a `Lineup` as the loop does, without a model: jobs arriving at the turns given, each
    done after `steps` of its steps. The turn each job finished (by id), and each turn's rows
    taken beside the rows every job with work would take."""
    lineup: Lineup = Lineup()
    active: list[Job] = []
    done: dict[str, int] = {}
    taken: list[tuple[int, int]] = []
    progress: Counter[str] = Counter()
    turn = 0
    while turn <= max(arrivals) or lineup or active:
        for arrived in arrivals.get(turn, []):
            lineup.append(arrived)
        wanted = rows(active, list(lineup))
        run, admitted = lineup.pick(active, max_rows)
        active += admitted
        taken.append((rows(run, admitted), wanted))
        for stepped in run + admitted:
            progress[stepped.id] += 1
            if progress[stepped.id] == steps:
                active.remove(stepped)
                done[stepped.id] = turn
        turn += 1
    return done, taken


def test_the_step_takes_every_row_while_any_key_has_work_and_a_lone_key_beats_each_flood_s_fifth() -> None:
    """Three keys flood 6 two-row requests each at turn 0; a lone key sends one at turn 3, once
    the floods fill the step. No row idles while work waits, the lone request runs every step
    from its arrival, and it is done before any flood's 5th."""
    steps = 20
    floods = {key: [job(key) for _ in range(6)] for key in "abc"}
    lone = job("lone")
    done, taken = simulate({0: [j for flood in floods.values() for j in flood], 3: [lone]}, steps)
    assert all(took == min(16, wanted) for took, wanted in taken)  # every row work can take
    assert sum(took for took, _ in taken) == rows(*floods.values(), [lone]) * steps
    assert done[lone.id] == 3 + steps - 1  # never parked
    for flood in floods.values():
        assert done[lone.id] < sorted(done[j.id] for j in flood)[4]
    _, shared = simulate({0: [job(key) for key in "abc" for _ in range(6)]}, steps)
    _, alone = simulate({0: [job("a") for _ in range(18)]}, steps)
    assert len(shared) <= len(alone)  # three keys' 18 take no more turns than one key's 18


FLOODS = ("flood", "flood-b", "flood-c")
KEYS = {name: f"sk-{name}-0123456789" for name in (*FLOODS, "lone", "admin")}
STEPS = 20  # the lone request may arrive some steps into the floods' first batch: half its steps


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder: Path = tmp_path_factory.mktemp("keys")
    (folder / "keys").write_text("".join(f"{KEYS[name]}\n" for name in (*FLOODS, "lone")))
    (folder / "admins").write_text(f"{KEYS['admin']}\n")
    with live_server(  # one step loop: the floods and the lone request share it
        "--api-key-file",
        str(folder / "keys"),
        "--admin-key-file",
        str(folder / "admins"),
        "--threads",
        "1",
        "--parallel",
        "off",
    ) as running:
        yield running


def client(server: LiveServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=120)


def test_a_lone_key_s_request_finishes_before_each_flood_s_fifth_and_sees_only_its_own_jobs(
    keyed: LiveServer,
) -> None:
    """Three keys send 6 requests each at once; once they fill the step, a fourth key sends one."""
    done: dict[str, float] = {}
    start = threading.Barrier(18)

    def send(key: str, name: str, seed: int) -> None:
        if key in FLOODS:
            start.wait(timeout=60)
        body = {"prompt": "a red circle", "seed": seed, "num_inference_steps": STEPS}
        with client(keyed, key) as http:
            answer = http.post("/v1/images/generations", json=body, headers={"x-request-id": name})
        assert answer.status_code == 200, answer.text
        done[name] = time.monotonic()

    with (
        ThreadPoolExecutor(19) as pool,
        client(keyed, "lone") as lone,
        client(keyed, "admin") as admin,
    ):
        floods = [
            pool.submit(send, key, f"{key}-{i}", 6 * k + i) for k, key in enumerate(FLOODS) for i in range(6)
        ]
        wait_until(
            lambda: len(admin.get("/v1/stats").json()["engine"]["progress"]) >= 8,
            60,
            "the floods filling the batch",
        )
        assert lone.get("/v1/stats").json()["engine"]["progress"] == {}  # none of them is the lone key's
        single = pool.submit(send, "lone", "lone-1", 99)
        seen = wait_until(
            lambda: (p := lone.get("/v1/stats").json()["engine"]["progress"]) and p,
            60,
            "the lone request running",
        )
        assert set(seen) == {"lone-1"}
        single.result(timeout=120)
        for sent in floods:
            sent.result(timeout=240)
    for key in FLOODS:
        flood_done = sorted(t for name, t in done.items() if name.rsplit("-", 1)[0] == key)
        assert done["lone-1"] < flood_done[4], (key, [round(t - flood_done[0], 2) for t in flood_done])


def test_one_key_cannot_take_the_whole_line(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text(f"{KEYS['flood']}\n{KEYS['lone']}\n")
    with live_server(
        "--api-key-file", str(tmp_path / "keys"), "--max-queue", "4", "--max-batch", "2", "--threads", "1"
    ) as server:
        body = {"prompt": "a red circle", "num_inference_steps": 30}
        start = threading.Barrier(5)

        def send(key: str, wait: bool = True) -> httpx.Response:
            if wait:
                start.wait(timeout=60)
            with client(server, key) as http:
                return http.post("/v1/images/generations", json=body)

        with ThreadPoolExecutor(7) as pool, client(server, "lone") as lone:
            running = pool.submit(send, "flood", False)
            wait_until(lambda: lone.get("/v1/stats").json()["engine"]["active_jobs"] == 1, 60, "one running")
            waves = [pool.submit(send, "flood") for _ in range(5)]
            answers = [w.result(timeout=120) for w in waves]
            refused = [a for a in answers if a.status_code == 429]
            # two wait (half the line of 4); the other three are told to retry later
            assert len(refused) == 3, [a.status_code for a in answers]
            error = refused[0].json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "2 requests waiting" in error["message"]
            assert refused[0].headers["retry-after"].isdigit()
            mine = lone.post("/v1/images/generations", json=body)  # another key still gets in line
            assert mine.status_code == 200, mine.text
            assert running.result(timeout=120).status_code == 200
            assert sorted(a.status_code for a in answers) == [200, 200, 429, 429, 429]


def test_a_step_budget_admits_by_work_and_a_large_request_runs_alone_in_its_turn() -> None:
    """16 native rows of 64² work: eight small guided requests fill it; a 256² one (16x the
    pixels) runs alone, and the small ones behind it wait their turn instead of jumping it."""
    budget = 16 * 64 * 64
    small = [sized(64) for _ in range(9)]
    assert line_of(*small).pick([], max_rows=16, max_work=budget) == ([], small[:8])
    large = sized(256)
    lineup = line_of(small[0], large, small[1])
    assert lineup.pick([], max_rows=16, max_work=budget) == ([], [small[0]])  # large would not fit beside it
    assert lineup.pick([small[0]], max_rows=16, max_work=budget) == (
        [small[0]],
        [],
    )  # first come, first served
    assert lineup.pick([], max_rows=16, max_work=budget) == ([], [large])  # alone: it runs
    assert lineup.pick([large], max_rows=16, max_work=budget) == ([large], [])
    assert lineup.pick([], max_rows=16, max_work=budget) == ([], [small[1]])
