"""Who runs next: the waiting line of one step loop, fair between owners (API keys).

Each owner has its own line, first come first served; owners take turns (round-robin), so a
key that sends a flood waits behind itself, not in front of everyone. While several owners have
work (waiting or admitted), each may fill at most an equal share of a step's rows: the rest of
its admitted jobs are parked at the step boundary (they keep their state, and their place) and
go on once the others' work ends. A lone owner gets every row, as without keys.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterator, Sequence

from server.serving.jobs import Job, place_in_line


class Lineup:
    def __init__(self) -> None:
        self._lines: dict[str | None, deque[Job]] = {}  # owner → its waiting jobs, oldest first
        self._turn = 0  # which owner goes first this turn: turns rotate

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
        """The admitted jobs to step this turn and the waiting jobs to admit now, at most
        `max_rows` rows and `max_work` pixel-rows (rows × their images' pixels) in all (a job
        bigger than either runs alone) and, while several owners have
        work, at most an equal share each (at least one job each). Each owner's admitted jobs
        come before its waiting ones, in order; an owner whose next job does not fit stops there."""
        owners = list(dict.fromkeys([*(j.owner for j in active), *self._lines]))
        start = self._turn % max(1, len(owners))
        owners = owners[start:] + owners[:start]  # who goes first rotates
        share = max_rows / max(1, len(owners))
        pending = {o: deque(j for j in active if j.owner == o) for o in owners}
        for owner, line in self._lines.items():
            pending[owner].extend(line)
        run, admit, rows, work, taken = [], [], 0, 0, Counter()
        while pending:
            for owner in list(pending):
                job = pending[owner][0]
                cost = job.pixel_rows if max_work < math.inf else 0
                fits = rows == 0 or (rows + job.rows <= max_rows and work + cost <= max_work)
                if not fits or (taken[owner] and taken[owner] + job.rows > share):
                    del pending[owner]
                    continue
                (run if job in active else admit).append(job)
                rows, work, taken[owner] = rows + job.rows, work + cost, taken[owner] + job.rows
                pending[owner].popleft()
                if not pending[owner]:
                    del pending[owner]
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
