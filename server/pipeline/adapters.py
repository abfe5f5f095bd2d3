"""Which rows of a call ask for which adapter (`rows_asking`), and adapters changed while
serving: loaded and unloaded at runtime without disturbing the calls in flight (`lora.py` holds
the adapters themselves).

Two guards. `CHANGES`: every call that may run the adapters' hooks reads under it
(`rows_asking`), and attaching or detaching an adapter writes under it, so a hook, a
layer's stacked pairs or a module's hook table never change under a forward that is running.
`Uses`: how many jobs hold each adapter; an adapter being unloaded takes no new job and is
detached once its last job ends, so a request that asked for it finishes with it.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from server.errors import InvalidRequest


class ChangeLock:
    """Many readers (the step loops' calls) or one writer (an adapter attached or detached).
    Writers go first once waiting, so steady traffic cannot starve an unload; a thread already
    reading reads again freely (nested calls: the step cache narrows a call's rows inside it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._depth = threading.local()

    @contextmanager
    def reading(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                while self._writing or self._writers_waiting:
                    self._cond.wait()
                self._readers += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                with self._cond:
                    self._readers -= 1
                    if self._readers == 0:
                        self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        if getattr(self._depth, "n", 0):  # it would wait for itself
            raise RuntimeError("an adapter cannot be attached or detached from inside a model call")
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # as --lora's names (config.ADAPTER_NAME)


def adapter_file(name: str, file: str, folder: Path) -> Path:
    """`file` inside `folder` as a runtime adapter's path: a client names a file of the operator's
    folder, never a server path. InvalidRequest names the field that is wrong."""
    if not NAME.fullmatch(name):
        raise InvalidRequest("name", "a name is 1-64 letters, digits, _ . - (first a letter or digit)")
    root = folder.resolve()
    path = (root / file).resolve()  # links followed: one pointing out of the folder is refused
    if not path.is_relative_to(root) or path == root:
        raise InvalidRequest("file", f"{file!r} is not inside the adapter folder (--lora-dir)")
    if path.suffix != ".safetensors" or not path.is_file():
        raise InvalidRequest("file", f"{file!r} is not a .safetensors file in the adapter folder")
    return path


CHANGES = ChangeLock()  # one per process: rows_asking does not know which pipeline it serves


class Uses:
    """Jobs holding each adapter, and the adapters leaving (unloaded, still in use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count: Counter[str] = Counter()
        self.leaving: set[str] = set()

    def hold(self, names: Iterable[str]) -> None:
        """Count a job's adapters; InvalidRequest if one is being unloaded (nothing counted)."""
        names = set(names)
        with self._lock:
            for name in sorted(names & self.leaving):
                raise InvalidRequest("lora", f"adapter {name!r} is being unloaded: it takes no new request")
            self.count.update(names)

    def release(self, names: Iterable[str]) -> list[str]:
        """A job's end; the leaving adapters it was the last user of (to detach now)."""
        free = []
        with self._lock:
            for name in set(names):
                self.count[name] -= 1
                if self.count[name] <= 0:
                    del self.count[name]
                    if name in self.leaving:
                        free.append(name)
        return free

    def leave(self, name: str) -> int:
        """Mark `name` leaving; the jobs still holding it (0: detach it now)."""
        with self._lock:
            self.leaving.add(name)
            return self.count[name]

    def gone(self, name: str) -> None:
        with self._lock:
            self.leaving.discard(name)


Choice = tuple[tuple[str, float], ...]  # a request's adapters: (name, scale), in order

_asking = threading.local()  # .plan: the RowPlan of the call in flight on this thread


class Stacked(Protocol):
    """What a plan needs of a layer's stacked adapters (lora.Stacked): their names and ranks."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]


class RowPlan:
    """Which rows of one call ask for which adapter, at what scale. Per set of adapters a layer
    holds, a mask [rows, their ranks stacked] of each row's scale, made once per call and device
    (not once per layer)."""

    def __init__(self, rows: Sequence[Choice]) -> None:
        self.rows = rows
        self._masks: dict[tuple, torch.Tensor | None] = {}

    def mask(self, stacked: Stacked, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """[rows, sum of ranks]: a row's scale for each adapter's columns (0: not asked); None if
        no row asks for any of `stacked`'s adapters."""
        key = (stacked.names, stacked.ranks, device, dtype)
        if key not in self._masks:
            scales = [dict(choice) for choice in self.rows]
            per_column = [
                [s.get(n, 0.0) for n, r in zip(stacked.names, stacked.ranks, strict=True) for _ in range(r)]
                for s in scales
            ]
            asked = any(n in s for s in scales for n in stacked.names)
            self._masks[key] = torch.tensor(per_column, device=device, dtype=dtype) if asked else None
        return self._masks[key]


def current_plan() -> RowPlan | None:
    """The RowPlan of the call in flight on this thread (None: no row asks for an adapter)."""
    return getattr(_asking, "plan", None)


class RowsMismatch(RuntimeError):
    """A hooked call's batch is not the rows its plan describes: which rows get which adapter is
    unknown, so the call fails (the step's job fails) instead of skipping the adapters."""


@contextmanager
def rows_asking(rows: Sequence[Choice]) -> Iterator[None]:
    """Within: the calls on this thread carry `rows` (one Choice per row of their batch), and no
    adapter is attached or detached (`CHANGES`)."""
    before = getattr(_asking, "plan", None)
    with CHANGES.reading():
        _asking.plan = RowPlan(rows) if any(rows) else None
        try:
            yield
        finally:
            _asking.plan = before
