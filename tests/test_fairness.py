"""Fairness between API keys (issue 22): the line's order and shares (`Lineup`, as plain values),
then through the real server: a flood from one key does not hold back another key's request,
and /v1/stats shows each key only its own jobs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server.pipeline import GenerationRequest
from server.serving.jobs import Job
from server.serving.lineup import Lineup
from tests.live import LiveServer, live_server
from tests.waiting import wait_until


def job(owner: str | None, rows: int = 2) -> Job:
    return Job([GenerationRequest("a")], rows, 60.0, owner=owner)


def sized(side: int, rows: int = 2) -> Job:
    return Job([GenerationRequest("a", width=side, height=side)], rows, 60.0)


def line_of(*jobs: Job) -> Lineup:
    lineup = Lineup()
    for queued in jobs:
        lineup.append(queued)
    return lineup


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
    big = job("a", rows=40)
    assert line_of(big, job("b")).pick([], max_rows=16) == ([], [big])


def test_a_second_owner_gets_half_the_rows_and_the_flood_s_latest_jobs_are_parked() -> None:
    flood = [job("a") for _ in range(8)]  # 16 rows: every row of the step
    lone = job("b")
    run, admitted = line_of(lone).pick(flood, max_rows=16)
    assert admitted == [lone]
    assert run == flood[:4]  # the flood keeps its earliest four; the rest wait a turn
    run, admitted = Lineup().pick(flood, max_rows=16)  # the other owner gone: all of them again
    assert run == flood and admitted == []


def test_jobs_without_an_owner_share_one_line_first_come_first_served() -> None:
    jobs = [job(None) for _ in range(5)]
    lineup = line_of(*jobs)
    assert list(lineup) == jobs
    assert lineup.pick([], max_rows=6)[1] == jobs[:3]


KEYS = {"flood": "sk-flood-0123456789", "lone": "sk-lone-0123456789", "admin": "sk-admin-0123456789"}
STEPS = 20  # the lone request may arrive some steps into the flood's first batch: half its steps


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder: Path = tmp_path_factory.mktemp("keys")
    (folder / "keys").write_text(f"{KEYS['flood']}\n{KEYS['lone']}\n")
    (folder / "admins").write_text(f"{KEYS['admin']}\n")
    with live_server(  # one step loop (--threads 1): the flood and the lone request share it
        "--api-key-file", str(folder / "keys"), "--admin-key-file", str(folder / "admins"), "--threads", "1"
    ) as running:
        yield running


def client(server: LiveServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=120)


def test_a_lone_key_s_request_finishes_before_the_flood_s_fifth_and_sees_only_its_own_jobs(
    two_keys: LiveServer,
) -> None:
    done: dict[str, float] = {}
    start = threading.Barrier(20)

    def send(key: str, name: str, seed: int) -> None:
        if key == "flood":
            start.wait(timeout=60)
        body = {"prompt": "a red circle", "seed": seed, "num_inference_steps": STEPS}
        with client(two_keys, key) as http:
            answer = http.post("/v1/images/generations", json=body, headers={"x-request-id": name})
        assert answer.status_code == 200, answer.text
        done[name] = time.monotonic()

    with (
        ThreadPoolExecutor(21) as pool,
        client(two_keys, "lone") as lone,
        client(two_keys, "admin") as admin,
    ):
        flood = [pool.submit(send, "flood", f"flood-{i}", i) for i in range(20)]
        wait_until(
            lambda: len(admin.get("/v1/stats").json()["engine"]["progress"]) >= 8,
            60,
            "the flood filling the batch",
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
        for sent in flood:
            sent.result(timeout=240)
    flood_done = sorted(t for name, t in done.items() if name.startswith("flood"))
    assert done["lone-1"] < flood_done[4], [round(t - flood_done[0], 2) for t in flood_done]


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
