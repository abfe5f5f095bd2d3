"""Compiling beside serving: what a trace on one thread does to the calls of every other.

Two things torch keeps for the whole process while it compiles:
- torch.fx's tracer replaces `nn.Module.__call__` and `__getattr__` on the class while it
  traces (`Tracer.trace`), so a step loop's eager call on another thread during a background
  compile ran through the tracer: it failed (`NameError: module is not installed as a
  submodule`, a 500 for ~1 request in 12 during a cold start) or its module calls landed in the
  trace. The trace gate makes a trace wait for the calls in flight and the calls wait for it.
- `torch.compiler.is_compiling()` is one flag, True on every thread for the whole of a compile:
  an adapter's hook that asked it dropped the adapter from eager rows served meanwhile.
  `compiling_here()` asks this thread alone.

And one thing the interpreter keeps: the GIL. Dynamo's tracing and inductor's lowering are
Python through and through, and an eager call takes the GIL back after every operator: beside a
compile, a step loop's calls waited for it most of the time, whatever the compile's nice value
or the switch interval (docs/serving.md has the figures). So a background compile gives way
(`GiveWay`): it pauses while the step loops have work.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import FrameType
from typing import Any

import torch

TORCH_DIR = str(Path(torch.__file__).parent)


class TraceGate:
    """Eager calls share it; a trace holds it alone, once the calls in flight have ended (a
    waiting trace goes before new calls, so a busy step loop cannot starve it). Re-entrant on
    one thread: a trace within a trace, or a trace a call makes itself, never waits on itself."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._calls: dict[int, int] = {}  # thread id -> calls in flight on it
        self._tracer: int | None = None  # the thread tracing, if any
        self._depth = 0
        self.traces_waiting = 0
        self.queued = 0  # calls waiting for a trace to end

    def tracing_here(self) -> bool:
        """Whether this thread holds the gate (calls wait for it: it must not wait for them)."""
        return self._tracer == threading.get_ident()

    @contextmanager
    def call(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._changed:
            if self._tracer != me and (self._tracer is not None or self.traces_waiting):
                self.queued += 1
                try:
                    self._changed.wait_for(lambda: self._tracer is None and not self.traces_waiting)
                finally:
                    self.queued -= 1
            self._calls[me] = self._calls.get(me, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                self._calls[me] -= 1
                if not self._calls[me]:
                    del self._calls[me]
                self._changed.notify_all()

    @contextmanager
    def trace(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._changed:
            if self._tracer != me:
                self.traces_waiting += 1
                try:
                    self._changed.wait_for(lambda: self._tracer is None and not set(self._calls) - {me})
                finally:
                    self.traces_waiting -= 1
                self._tracer = me
            self._depth += 1
        try:
            yield
        finally:
            with self._changed:
                self._depth -= 1
                if not self._depth:
                    self._tracer = None
                self._changed.notify_all()

    @contextmanager
    def held_whole(self) -> Iterator[None]:
        """The trace and the gate's own lock, for a fork inside: a child forked there holds its
        copy of the gate (its only thread has the forking thread's id) with no call in flight,
        where a copy taken mid-call would wait forever for calls no thread of its own makes."""
        with self.trace(), self._changed:
            yield


@cache
def trace_gate() -> TraceGate:
    """The process's gate (the tracer's patch is the process's), its traces gated from now on:
    `torch.fx.Tracer.trace` wrapped once (make_fx's and export's tracers inherit or call it)."""
    gate = TraceGate()
    untraced = torch.fx.Tracer.trace

    def trace(self: torch.fx.Tracer, *args: Any, **kwargs: Any) -> torch.fx.Graph:
        with gate.trace():
            return untraced(self, *args, **kwargs)

    torch.fx.Tracer.trace = trace  # type: ignore[method-assign]
    return gate


class CompileStopped(BaseException):
    """Raised inside a background compile told to stop (`GiveWay.stop`): a BaseException, so
    that no `except Exception` in torch turns it into a fallback."""


class GiveWay:
    """A background compile that gives way to serving: the service says when its step loops have
    work (`serving`), and the compile thread, inside `paused_while_serving`, stops at the next
    Python call it makes into torch (dynamo's tracing, inductor's lowering, the timed calls of
    `--compile auto`) until they have none, holding no core and no GIL meanwhile. It never stops
    while it holds the trace gate (the calls wait for that trace to end) nor a lock the step
    loops take (`holding_shared`: the warm-up's prompts are encoded under the encoders' lock). What
    runs outside Python (a C++ compiler's process) goes on, at the compile's nice value.

    `stop` ends the compile at its next such call (`CompileStopped`): a server shutting down
    must not leave a thread inside torch while the interpreter exits (it crashed the exit)."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = False
        self._ended = threading.Event()
        self._ended.set()  # no compile runs
        self.pauses = 0

    def serving(self, busy: bool) -> None:
        """The step loops have work (True) or have none left (False)."""
        if busy and not self._stopping:
            self._idle.clear()
        else:
            self._idle.set()

    def wait(self) -> None:
        """Until the step loops have no work; CompileStopped once told to stop."""
        if not self._idle.is_set():
            self.pauses += 1
            self._idle.wait()
        if self._stopping:
            raise CompileStopped

    def stop(self, timeout_s: float) -> bool:
        """End the compile at its next call into torch; whether it ended within `timeout_s`."""
        self._stopping = True
        self._idle.set()
        return self._ended.wait(timeout_s)

    @contextmanager
    def paused_while_serving(self) -> Iterator[None]:
        """On the compile's thread: what runs inside stops whenever the step loops have work."""
        idle, gate = self._idle, trace_gate()

        def on_call(frame: FrameType, event: str, arg: Any) -> None:
            # A global trace function, called as each frame begins: returning None traces no lines.
            if (idle.is_set() and not self._stopping) or gate.tracing_here() or holds_shared():
                return None
            # only in torch's frames: never in one of ours that may hold a lock the step loops
            # take (the trace gate's, waiting for their calls to end), nor in logging's
            if frame.f_code.co_filename.startswith(TORCH_DIR):
                self.wait()
            return None

        self._ended.clear()
        previous = sys.gettrace()
        sys.settrace(on_call)
        try:
            yield
        finally:
            sys.settrace(previous)
            self._ended.set()


_holding = threading.local()


@contextmanager
def holding_shared() -> Iterator[None]:
    """What runs inside holds a lock the step loops take too: a compile giving way must not pause
    there, or the loops would wait for it while it waits for them to have no work (a deadlock)."""
    hold_shared()
    try:
        yield
    finally:
        release_shared()


def hold_shared() -> None:
    """`holding_shared` for a lock taken and let go apart (a stage gate: `gates.py`)."""
    _holding.depth = getattr(_holding, "depth", 0) + 1


def release_shared() -> None:
    _holding.depth -= 1


def holds_shared() -> bool:
    return getattr(_holding, "depth", 0) > 0


_compiling = threading.local()


@contextmanager
def compiling_on_this_thread() -> Iterator[None]:
    """What runs inside compiles graphs (or times them): `compiling_here()` says so here only."""
    _compiling.depth = getattr(_compiling, "depth", 0) + 1
    try:
        yield
    finally:
        _compiling.depth -= 1


@torch.compiler.assume_constant_result  # traced: its value on the compiling thread, a constant
def compiling_here() -> bool:
    """Whether this thread is compiling (`torch.compiler.is_compiling()` answers for any thread)."""
    return getattr(_compiling, "depth", 0) > 0
