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
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence

from server.serving.jobs import Job, place_in_line


class Lineup:
    def __init__(self) -> None:
        self._lines: dict[str | None, deque[Job]] = {}  # owner → its waiting jobs, oldest first
        self._turn = 0  # which owner goes first this turn: turns rotate
        self._credit: dict[str | None, float] = {}  # owner → DRR credit carried between steps, in steps

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def __bool__(self) -> bool:
        return bool(self._lines)

    def __iter__(self) -> Iterator[Job]:
        """The waiting jobs in the order they would be admitted: owners in turn."""
        lines = [list(line) for line in self._rotated()]
        for depth in range(max(map(len, lines), default=0)):
            yield from (line[depth] for line in lines if depth < len(line))

    def waiting(self, owner: str | None) -> int:
        return len(self._lines.get(owner, ()))

    def append(self, job: Job) -> None:
        self._lines.setdefault(job.owner, deque()).append(job)
        job.queue_position = len(self)
        self.renumber()

    def remove(self, jobs: Sequence[Job]) -> None:
        for job in jobs:
            line = self._lines[job.owner]
            line.remove(job)
            if not line:
                del self._lines[job.owner]
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
        self, active: Sequence[Job], max_rows: int, max_work: float = math.inf
    ) -> tuple[list[Job], list[Job]]:
        """The admitted jobs to step this turn and the waiting jobs to admit now: at most
        `max_rows` rows and `max_work` pixel-rows (rows × their images' pixels) in all (a job
        bigger than either runs alone), shared between owners by deficit round robin and filled
        while any job fits. Each owner's admitted jobs come before its waiting ones, in order; an
        owner whose next job does not fit stops there for this step."""
        owners = list(dict.fromkeys([*(j.owner for j in active), *self._lines]))
        start = self._turn % max(1, len(owners))
        owners = owners[start:] + owners[:start]  # who goes first among equals rotates
        pending = {o: deque(j for j in active if j.owner == o) for o in owners}
        for owner, line in self._lines.items():
            pending[owner].extend(line)
        # A round is a step: each owner with work earns an equal part of it (the quantum).
        credit = {o: self._credit.get(o, 0.0) + 1 / len(owners) for o in owners}

        def share(job: Job) -> float:  # the part of a step a job takes: rows or work, the larger
            return max(job.rows / max_rows, job.pixel_rows / max_work if max_work < math.inf else 0.0)

        running = {id(j) for j in active}
        run, admit, rows, work = [], [], 0, 0
        # First what each owner's credit pays for, then (work-conserving) whatever still fits,
        # charged to it; a job at a time per owner in turn, so the rows come out even.
        for paid in (True, False):
            # the most owed first; among equals, whose turn it is
            turn = sorted((o for o in owners if pending[o]), key=lambda o: -round(credit[o], 9))
            while turn:
                for owner in list(turn):
                    job = pending[owner][0]
                    cost = job.pixel_rows if max_work < math.inf else 0
                    too_big = rows and (rows + job.rows > max_rows or work + cost > max_work)
                    if too_big or (paid and share(job) > credit[owner]):
                        turn.remove(owner)  # done for this pass: its jobs keep their order
                        continue
                    (run if id(job) in running else admit).append(job)
                    rows, work, credit[owner] = rows + job.rows, work + cost, credit[owner] - share(job)
                    pending[owner].popleft()
                    if not pending[owner]:
                        turn.remove(owner)
        # Carried only by owners left with jobs that did not run (DRR: a line served to its end
        # banks nothing), within bounds: a step's worth owed (or, for a job bigger than a step,
        # that job's) and a step's worth borrowed.
        self._credit = {
            o: min(max(1.0, share(pending[o][0])), max(-1.0, credit[o])) for o in owners if pending[o]
        }
        self.remove(admit)
        self._turn += 1
        return run, admit

    def _rotation(self) -> list[str | None]:
        owners = list(self._lines)
        if not owners:
            return owners
        start = self._turn % len(owners)
        return owners[start:] + owners[:start]

    def _rotated(self) -> list[deque[Job]]:
        return [self._lines[o] for o in self._rotation()]
