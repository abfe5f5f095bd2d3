"""Adapters changed while serving: loaded and unloaded at runtime without disturbing the calls
in flight (`adapters.py` holds the adapters themselves; which rows ask for which adapter travels
in each call's plan, `server.engine.runtime.call`).

Two guards. `CHANGES`: every call that may run the adapters' hooks reads under it (a step, an
encoding), and attaching or detaching an adapter writes under it, so a hook, a layer's stacked
pairs or a module's hook table never change under a forward that is running.
`Uses`: how many jobs hold each adapter; an adapter being unloaded takes no new job and is
detached once its last job ends, so a request that asked for it finishes with it.
"""

from __future__ import annotations

import difflib
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from server.engine.runtime.tracing import holding_shared
from server.errors import InvalidRequest


class ChangeLock:
    """Many readers (the step loops' calls) or one writer (an adapter attached or detached).
    Writers go first once waiting, so steady traffic cannot starve an unload. Not reentrant: a
    call reads once, around everything it runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            with holding_shared():  # a waiting writer holds up the step loops' reads
                yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
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


def runtime_path(name: str, given: str, folder: Path, field: str, setting: str) -> Path:
    """`given` inside `folder` (`setting`'s) as the path of what an admin loads as `name`: a client
    names something of the operator's folder, never a server path. InvalidRequest names the field
    that is wrong (`name`, or `field`: the file's or folder's)."""
    if not NAME.fullmatch(name):
        raise InvalidRequest("name", "a name is 1-64 letters, digits, _ . - (first a letter or digit)")
    root = folder.resolve()
    path = (root / given).resolve()  # links followed: one pointing out of the folder is refused
    if not path.is_relative_to(root) or path == root:
        raise InvalidRequest(field, f"{given!r} is not inside the {setting} folder")
    return path


def adapter_file(name: str, file: str, folder: Path) -> Path:
    """`file` inside `folder` as a runtime adapter's path (`runtime_path`)."""
    path = runtime_path(name, file, folder, "file", "--lora-dir")
    if path.suffix != ".safetensors" or not path.is_file():
        raise InvalidRequest("file", f"{file!r} is not a .safetensors file in the adapter folder")
    return path


CHANGES = ChangeLock()  # one per process: pipelines share the encoders' and denoisers' hook tables


class Uses:
    """Jobs holding each of the things loaded at runtime (adapters, ControlNets), and those leaving
    (unloaded, still in use). A request names them in `field`."""

    def __init__(self, field: str = "lora", noun: str = "adapter") -> None:
        self._lock = threading.Lock()
        self.field, self.noun = field, noun
        self.count: Counter[str] = Counter()
        self.leaving: set[str] = set()

    def hold(self, names: Iterable[str], served: Callable[[str], bool] = lambda _: True) -> None:
        """Count a job's names; InvalidRequest if one is being unloaded or no longer `served`
        (unloaded since its request was checked): nothing counted then."""
        names = set(names)
        with self._lock:
            for name in sorted(n for n in names if n in self.leaving or not served(n)):
                message = f"{self.noun} {name!r} is being unloaded: it takes no new request"
                raise InvalidRequest(self.field, message)
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


class RowsMismatch(RuntimeError):
    """A hooked call's batch is not the rows its plan describes: which rows get which adapter is
    unknown, so the call fails (the step's job fails) instead of skipping the adapters."""


def unknown_adapter(name: str, loaded: Mapping[str, object]) -> str:
    return unknown("adapter", name, loaded, "this server loads none (serve --lora NAME=FILE)")


def unknown(kind: str, name: str, loaded: Mapping[str, object], none: str) -> str:
    """What to tell a request asking for a `kind` not served: the nearest name, and those loaded
    (`none`: what to say where none is)."""
    if not loaded:
        return f"no {kind} named {name!r}: {none}"
    close = difflib.get_close_matches(name, loaded, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return f"no {kind} named {name!r}{hint} Loaded: {', '.join(sorted(loaded))} (GET /v1/models)"
