"""Compiling on one thread while another serves (`server/engine/runtime/tracing.py`): torch.fx's
tracer patches `nn.Module` for the whole process while it traces, and torch's "is compiling"
flag is the whole process's, so both are exercised here with real traces on a second thread."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from server.engine.runtime.call import AdapterRows, RowsSlot
from server.engine.runtime.gates import StageGates
from server.engine.runtime.tracing import (
    CompileStopped,
    GiveWay,
    compiling_here,
    compiling_on_this_thread,
    trace_gate,
)
from server.pipeline.conditioning.adapters import Adapter, AdapterSet, LoraPair, Target
from server.pipeline.conditioning.live_changes import CHANGES
from tests.support.waiting import wait_until

DEADLINE_S = 30


def _trace_paused(inside: threading.Event, go_on: threading.Event) -> threading.Thread:
    """A thread tracing a function (torch.fx, as inductor's passes do) that stops in the middle
    of its trace until `go_on`."""

    def traced(x: torch.Tensor) -> torch.Tensor:
        inside.set()
        assert go_on.wait(DEADLINE_S)
        return x + 1

    thread = threading.Thread(target=torch.fx.symbolic_trace, args=(traced,), daemon=True)
    thread.start()
    assert inside.wait(DEADLINE_S), "the trace never began"
    return thread


@pytest.mark.parametrize("gated", [False, True], ids=["ungated (before)", "gated"])
def test_a_call_during_another_threads_trace_waits_for_it(gated: bool) -> None:
    """Ungated, a module called while another thread traces goes through the tracer's patched
    `nn.Module.__call__` and fails (the 500s of a cold start's background compile); gated, the
    call waits for the trace to end and then runs as it would have alone."""
    gate = trace_gate()
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    alone = model(x)
    inside, go_on, called = threading.Event(), threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def serve() -> None:
        try:
            if gated:
                with gate.call():
                    outcome["out"] = model(x)
            else:
                outcome["out"] = model(x)
        except Exception as err:
            outcome["error"] = err
        called.set()

    tracer = _trace_paused(inside, go_on)
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    if gated:
        wait_until(lambda: gate.queued == 1 or None, DEADLINE_S, "the call waiting for the trace")
        assert not called.is_set()
    else:
        assert called.wait(DEADLINE_S)
    go_on.set()
    tracer.join(DEADLINE_S)
    server.join(DEADLINE_S)
    if gated:
        torch.testing.assert_close(outcome["out"], alone)
    else:
        assert isinstance(outcome.get("error"), NameError), outcome


def test_a_trace_waits_for_the_calls_in_flight_and_goes_before_new_ones() -> None:
    gate = trace_gate()
    in_call, end_call, traced = threading.Event(), threading.Event(), threading.Event()

    def long_call() -> None:
        with gate.call():
            in_call.set()
            assert end_call.wait(DEADLINE_S)

    caller = threading.Thread(target=long_call, daemon=True)
    caller.start()
    assert in_call.wait(DEADLINE_S)
    tracer = threading.Thread(
        target=lambda: (torch.fx.symbolic_trace(lambda x: x * 2), traced.set()), daemon=True
    )
    tracer.start()
    wait_until(lambda: gate.traces_waiting == 1 or None, DEADLINE_S, "the trace waiting")

    def new_call() -> None:
        with gate.call():
            pass

    later = threading.Thread(target=new_call, daemon=True)
    later.start()
    wait_until(lambda: gate.queued == 1 or None, DEADLINE_S, "the new call queued behind the trace")
    assert not traced.is_set()
    end_call.set()
    assert traced.wait(DEADLINE_S), "the trace never ran once the call in flight ended"
    later.join(DEADLINE_S)
    assert gate.queued == 0


def test_an_adapter_row_run_while_another_thread_compiles_keeps_its_adapter(tmp_path: Path) -> None:
    """`torch.compiler.is_compiling()` is True on every thread while one compiles: a LoRA hook
    that asked it dropped its adapter from the rows served meanwhile. Asked of this thread
    (`compiling_here`), the row keeps it."""
    layer = nn.Linear(4, 4)
    model, slot = nn.Sequential(layer), RowsSlot()
    adapters = AdapterSet(Target(model, lambda name: slot), "unet")
    pair = LoraPair(down=torch.ones(1, 4), up=torch.ones(4, 1), alpha=1.0)
    adapters.add(Adapter("a", tmp_path / "a.safetensors", {"unet": {"0": pair}}))
    x = torch.ones(1, 4)
    slot.rows = AdapterRows(((("a", 1.0),),))
    adapted = model(x)
    torch.testing.assert_close(adapted, layer.weight.sum(1, keepdim=True).T + layer.bias + 4)

    inside, go_on = threading.Event(), threading.Event()

    @torch.compiler.assume_constant_result
    def paused() -> int:  # dynamo calls it while it traces
        inside.set()
        assert go_on.wait(DEADLINE_S)
        return 0

    def compile_() -> None:
        with compiling_on_this_thread():
            torch.compile(lambda t: t + paused(), fullgraph=True, backend="eager")(torch.zeros(1))

    compiler = threading.Thread(target=compile_, daemon=True)
    compiler.start()
    try:
        assert inside.wait(DEADLINE_S), "the compile never began"
        assert torch.compiler.is_compiling()  # torch's answer, on this thread that is not compiling
        assert not compiling_here()
        torch.testing.assert_close(model(x), adapted)
    finally:
        go_on.set()
        compiler.join(DEADLINE_S)


def _compiling(
    give_way: GiveWay, steps: list[int], stop_at: threading.Event, gated: bool = False
) -> threading.Thread:
    """A stand-in for the background compile: a thread under `give_way` calling into torch (a
    function of torch.nn.functional, Python in torch's own files) in a loop, counting its steps;
    `gated`: holding the trace gate meanwhile, as a trace does."""

    def run() -> None:
        with give_way.paused_while_serving(), trace_gate().trace() if gated else contextlib.nullcontext():
            while not stop_at.is_set():
                torch.nn.functional.relu(torch.ones(1))
                steps[0] += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: steps[0] > 0, DEADLINE_S, "the compile to begin")
    return thread


def test_a_background_compile_pauses_while_the_step_loops_have_work() -> None:
    """Told of work, the compile stops at its next call into torch and makes no progress while the
    work runs here; told it is done, it goes on."""
    give_way, steps, done = GiveWay(), [0], threading.Event()
    thread = _compiling(give_way, steps, done)
    give_way.serving(True)
    wait_until(lambda: give_way.pauses == 1, DEADLINE_S, "the compile to pause")
    paused_at = steps[0]
    for _ in range(50):  # the step loop's calls
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert steps[0] == paused_at
    give_way.serving(False)
    wait_until(lambda: steps[0] > paused_at, DEADLINE_S, "the compile to go on")
    done.set()
    thread.join(DEADLINE_S)


def test_a_compile_holding_the_trace_gate_never_pauses() -> None:
    """The step loops' calls wait for a trace in progress: pausing it for them would wait forever."""
    give_way, steps, done = GiveWay(), [0], threading.Event()
    thread = _compiling(give_way, steps, done, gated=True)
    give_way.serving(True)
    before = steps[0]
    wait_until(lambda: steps[0] > before + 100, DEADLINE_S, "the trace to go on")
    assert give_way.pauses == 0
    done.set()
    thread.join(DEADLINE_S)


def test_a_compile_holding_a_lock_the_step_loops_take_never_pauses() -> None:
    """The warm-up encodes its prompts under the encoders' lock and the adapters' readers' lock,
    which the step loops' requests take too: paused there, it held them up while it waited for
    them to have no work (one lane, two requests: no step in minutes). It pauses once it lets go."""
    give_way, steps, done, holding = GiveWay(), [0], threading.Event(), threading.Event()
    encoding = threading.Lock()

    def run() -> None:
        with give_way.paused_while_serving():
            with encoding, CHANGES.reading():
                holding.set()
                while not done.is_set():
                    torch.nn.functional.relu(torch.ones(1))
                    steps[0] += 1
            torch.nn.functional.relu(torch.ones(1))  # let go: here it pauses
            steps[0] = -1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    holding.wait(DEADLINE_S)
    give_way.serving(True)
    before = steps[0]
    wait_until(lambda: steps[0] > before + 100, DEADLINE_S, "the warm-up's encode to go on")
    done.set()
    assert encoding.acquire(timeout=DEADLINE_S)  # the step loop's request takes the lock it held
    encoding.release()
    wait_until(lambda: give_way.pauses == 1, DEADLINE_S, "the compile to pause once it let go")
    assert steps[0] != -1
    give_way.serving(False)
    thread.join(DEADLINE_S)
    assert steps[0] == -1


def test_a_compile_inside_a_stage_gate_never_pauses() -> None:
    """The warm-up's first call on a model that keeps a prefix (Qwen-Image 2.1) walks the served
    shard: paused while it held a stage's gate, the step loop's call waited at that gate and the
    compile for the loop to have no work (a request stuck 481 s). It pauses once it leaves."""
    give_way, steps, done, holding = GiveWay(), [0], threading.Event(), threading.Event()
    gates = StageGates(["cpu"])

    def run() -> None:
        with give_way.paused_while_serving():
            gates.enter(0)
            holding.set()
            while not done.is_set():
                torch.nn.functional.relu(torch.ones(1))
                steps[0] += 1
            gates.leave(0)
            torch.nn.functional.relu(torch.ones(1))  # left: here it pauses
            steps[0] = -1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    holding.wait(DEADLINE_S)
    give_way.serving(True)
    before = steps[0]
    wait_until(lambda: steps[0] > before + 100, DEADLINE_S, "the warm-up's call to go on")
    done.set()
    loop = threading.Thread(target=lambda: (gates.enter(0), gates.leave(0)), daemon=True)
    loop.start()
    loop.join(DEADLINE_S)
    assert not loop.is_alive()  # the step loop's call passed the gate
    wait_until(lambda: give_way.pauses == 1, DEADLINE_S, "the compile to pause once it left")
    assert steps[0] != -1
    give_way.serving(False)
    thread.join(DEADLINE_S)
    assert steps[0] == -1


def test_a_stopped_compile_ends_at_its_next_call_into_torch_even_while_paused() -> None:
    give_way, steps = GiveWay(), [0]
    ended: list[BaseException] = []

    def run() -> None:
        try:
            with give_way.paused_while_serving():
                while True:
                    torch.nn.functional.relu(torch.ones(1))
                    steps[0] += 1
        except CompileStopped as stopped:
            ended.append(stopped)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: steps[0] > 0, DEADLINE_S, "the compile to begin")
    give_way.serving(True)
    wait_until(lambda: give_way.pauses == 1, DEADLINE_S, "the compile to pause")
    assert give_way.stop(DEADLINE_S)
    thread.join(DEADLINE_S)
    assert ended and not thread.is_alive()
    give_way.serving(True)  # a stopped compile is never told to wait again
    assert give_way.stop(0)
