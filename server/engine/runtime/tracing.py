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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch


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
