"""Who runs next: the waiting line of one step loop, fair between owners (API keys).

Each owner has its own line, first come first served; owners take turns, so a key that sends a
flood waits behind itself, not in front of everyone. A step's rows are shared by deficit round
robin (DRR): every step, each owner with work earns an equal part of the step as credit, and a
job costs its part of the step (its rows of `--max-batch` or its work of the step budget, the
larger). Owners first take the jobs their credit pays for, most owed first; then, so that no row
idles while any owner has work (work-conserving), whatever still fits, charged to its owner. An
owner left with jobs that did not run carries its credit (at most a step's worth owed or
borrowed); one whose jobs all ran carries nothing. Over steps, owners of big and small jobs get
equal rows. Admitted jobs that get no row this step are parked at the step boundary (their
state and place kept) and go on at the next step their owner earns; an owner's oldest jobs run
first, so only a key's own later jobs are parked.

Parked jobs keep their deadline honest: a job's deadline counts from its arrival
(`Job.submitted`), so its time waiting in line and its time parked both count against
`--request-timeout-s`, and the loop drops a parked job past it like any other (504).

Two priority classes share a step, decided here and nowhere else. Interactive jobs take their
rows first, by the round robin above. Background jobs (Batch API lines, requests that ask for it)
have lines and credit of their own (a key's background work costs nothing of its interactive
share) and take only the room interactive work leaves, where room means time as well as rows: a
background job joins an interactive step only while the step's predicted seconds (`StepCosts`,
measured by the loop) grow by at most `BACKGROUND_MARGIN`, so on a CPU, where every row costs,
interactive steps run alone, and on a GPU, where rows under the knee are nearly free, they are
filled. With no interactive work, background work runs: held to short steps (as long, within the
margin, as its first job's call) while interactive work was seen lately, so a request arriving
mid-call waits little; the whole step once it has been away a while (`Room.calm`). Admitted
background jobs left out are parked like any other, their state kept.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from server.serving.jobs import BACKGROUND, INTERACTIVE, PRIORITIES, Job, place_in_line
from server.serving.stepcosts import StepCosts

# How much slower background rows may make an interactive step (its predicted seconds), and a
# held background step than its first job alone: a small price for rows that would idle.
BACKGROUND_MARGIN = 0.05


@dataclass(frozen=True)
class Room:
    """What the loop measured for `Lineup.pick` to place background work by: its calls' costs
    (None: nothing measured, so no background row joins interactive work) and whether interactive
    work has been away long enough (`calm`) for background work to take a whole step."""

    costs: StepCosts | None = None
    calm: bool = True


Fits = Callable[[list[Job], Job], bool]  # (the class's jobs picked so far, the next) → may it join


class Lineup:
    def __init__(self) -> None:
        # (priority, owner) → its waiting jobs, oldest first
        self._lines: dict[tuple[str, str | None], deque[Job]] = {}
        self._turn = 0  # which owner goes first this turn: turns rotate
        # (priority, owner) → DRR credit carried between steps, in steps
        self._credit: dict[tuple[str, str | None], float] = {}

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def __bool__(self) -> bool:
        return bool(self._lines)

    def __iter__(self) -> Iterator[Job]:
        """The waiting jobs in the order they would be admitted: interactive first, then
        background; within each, owners in turn."""
        for priority in PRIORITIES:
            lines = [list(self._lines[(priority, o)]) for o in self._rotation(priority)]
            for depth in range(max(map(len, lines), default=0)):
                yield from (line[depth] for line in lines if depth < len(line))

    def waiting(self, owner: str | None, priority: str = INTERACTIVE) -> int:
        return len(self._lines.get((priority, owner), ()))

    def count(self, priority: str) -> int:
        """Jobs of the class waiting."""
        return sum(len(line) for (p, _), line in self._lines.items() if p == priority)

    def append(self, job: Job) -> None:
        self._lines.setdefault((job.priority, job.owner), deque()).append(job)
        job.queue_position = len(self)
        self.renumber()

    def remove(self, jobs: Sequence[Job]) -> None:
        for job in jobs:
            key = (job.priority, job.owner)
            self._lines[key].remove(job)
            if not self._lines[key]:
                del self._lines[key]
        if jobs:
            self.renumber()

    def renumber(self) -> None:
        place_in_line(iter(self))

    def drain(self) -> list[Job]:
        """Every waiting job, the line emptied."""
        jobs = list(self)
        self._lines.clear()
        return jobs

    def pick(
        self, active: Sequence[Job], max_rows: int, max_work: float = math.inf, room: Room = Room()
    ) -> tuple[list[Job], list[Job]]:
        """The admitted jobs to step this turn and the waiting jobs to admit now: at most
        `max_rows` rows and `max_work` pixel-rows (rows × their images' pixels) in all (a job
        bigger than either runs alone), shared between owners by deficit round robin and filled
        while any job fits; background jobs only in the room interactive ones leave (`room`).
        Each owner's admitted jobs come before its waiting ones, in order; an owner whose next
        job does not fit stops there for this step."""
        # 1. Interactive work: every row it can take.
        run, admit = self._deal(INTERACTIVE, active, [], max_rows, max_work, lambda picked, job: True)
        # 2. Background work: the rows, and the time, it leaves.
        interactive = run + admit
        fits = self._background_fits(interactive, room, max_rows)
        more_run, more_admit = self._deal(BACKGROUND, active, interactive, max_rows, max_work, fits)
        run, admit = run + more_run, admit + more_admit
        self.remove(admit)
        self._turn += 1
        return run, admit

    @staticmethod
    def _background_fits(interactive: list[Job], room: Room, max_rows: int) -> Fits:
        """Whether a background job may join the step (its first always may, when the step has
        no interactive job): freely when there is nobody to slow down (no interactive work, and
        none lately); else while the step's predicted seconds stay within the margin of what
        they would be without it (the interactive jobs', or the first background job's alone)."""
        if not interactive and room.calm:
            return lambda picked, job: True
        costs = room.costs

        def fits(picked: list[Job], job: Job) -> bool:
            if costs is None:
                return False
            base = costs.step_seconds(interactive or picked[:1], max_rows)
            after = costs.step_seconds([*interactive, *picked, job], max_rows)
            return bool(base) and after is not None and after <= (1 + BACKGROUND_MARGIN) * base

        return fits

    def _deal(
        self,
        priority: str,
        active: Sequence[Job],
        taken: list[Job],
        max_rows: int,
        max_work: float,
        fits: Fits,
    ) -> tuple[list[Job], list[Job]]:
        """One class's share of the step beside the jobs already `taken`: its admitted jobs to
        step and its waiting jobs to admit, by deficit round robin between its owners, each job
        also passing `fits`. The class's owners earn credit only in a step they get rows of."""
        lines = {o: line for (p, o), line in self._lines.items() if p == priority}
        mine = [j for j in active if j.priority == priority]
        owners = list(dict.fromkeys([*(j.owner for j in mine), *lines]))
        start = self._turn % max(1, len(owners))
        owners = owners[start:] + owners[:start]  # who goes first among equals rotates
        pending = {o: deque(j for j in mine if j.owner == o) for o in owners}
        for owner, line in lines.items():
            pending[owner].extend(line)
        # A round is a step: each owner with work earns an equal part of it (the quantum).
        carried = {o: self._credit.get((priority, o), 0.0) for o in owners}
        credit = {o: carried[o] + 1 / len(owners) for o in owners}

        def share(job: Job) -> float:  # the part of a step a job takes: rows or work, the larger
            return max(job.rows / max_rows, job.pixel_rows / max_work if max_work < math.inf else 0.0)

        def cost(job: Job) -> int:
            return job.pixel_rows if max_work < math.inf else 0

        running = {id(j) for j in mine}
        run: list[Job] = []
        admit: list[Job] = []
        rows, work = sum(j.rows for j in taken), sum(map(cost, taken))
        # First what each owner's credit pays for, then (work-conserving) whatever still fits,
        # charged to it; a job at a time per owner in turn, so the rows come out even.
        for paid in (True, False):
            # the most owed first; among equals, whose turn it is
            turn = sorted((o for o in owners if pending[o]), key=lambda o: -round(credit[o], 9))
            while turn:
                for owner in list(turn):
                    job = pending[owner][0]
                    too_big = rows and (
                        rows + job.rows > max_rows
                        or work + cost(job) > max_work
                        or not fits(run + admit, job)
                    )
                    if too_big or (paid and share(job) > credit[owner]):
                        turn.remove(owner)  # done for this pass: its jobs keep their order
                        continue
                    (run if id(job) in running else admit).append(job)
                    rows, work, credit[owner] = rows + job.rows, work + cost(job), credit[owner] - share(job)
                    pending[owner].popleft()
                    if not pending[owner]:
                        turn.remove(owner)
        if not run and not admit:  # no room for the class this step: nothing earned
            credit = carried
        # Carried only by owners left with jobs that did not run (DRR: a line served to its end
        # banks nothing), within bounds: a step's worth owed (or, for a job bigger than a step,
        # that job's) and a step's worth borrowed.
        self._credit = {k: c for k, c in self._credit.items() if k[0] != priority} | {
            (priority, o): min(max(1.0, share(pending[o][0])), max(-1.0, credit[o]))
            for o in owners
            if pending[o]
        }
        return run, admit

    def _rotation(self, priority: str) -> list[str | None]:
        owners = [o for p, o in self._lines if p == priority]
        if not owners:
            return owners
        start = self._turn % len(owners)
        return owners[start:] + owners[:start]
