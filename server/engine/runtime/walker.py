"""The block walker: the one way a denoiser call runs, whatever it asks.

It runs the spec's blocks in order (`DenoiserSpec.begin`, each block's `BlockCall`, `end`) and,
along the way: takes each stage's gate and moves the flow to the stage's device when it enters
one (a tensor crosses to a device once per call); tells the stage's adapter hooks which rows ask
for what (its `RowsSlot`); runs a block's compiled graph where the call may and a bucket holds
its rows; for a step-cached call, runs the deep blocks only on the refreshing rows; and, as a
rank of a sequence group (`sequence.py`), runs the blocks its spec lets split on its slice of
the tokens, gathering them back before any block that is not split and wherever it reads every
token.

    result = walk(shard, inputs, plan)   # result.out: [rows, C, h, w] on the shard's first device
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from server.engine.denoisers.blocks import BlockCall, CacheBoundary, DenoiserInputs, Flow, Layout
from server.engine.hardware.devices import host_values
from server.engine.runtime.call import AdapterRows, CallPlan, CallResult, Outcome, RowsSlot
from server.engine.runtime.compile import CompiledDenoiser
from server.engine.runtime.gates import StageGates
from server.engine.runtime.sequence import Rank


class Shard(Protocol):
    """What the walker reads of a shard (`shard.py`): its model as blocks, their stages, the
    stages' gates and slots, its compiled graphs."""

    model: nn.Module
    spec: Any
    layout: Layout
    calls: dict[str, BlockCall]
    boundary: CacheBoundary | None
    stage_of: dict[str, int]
    stage_devices: list[torch.device]
    device: torch.device
    gates: StageGates
    slots: list[RowsSlot]
    compiled: CompiledDenoiser | None


OnBlock = Callable[[str, Flow], None]


class TransferCache:
    """Copies made during one call, keyed by (source tensor, device)."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def move(self, obj: Any, device: torch.device) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device == device:
                return obj
            key = (id(obj), device)
            hit = self._copies.get(key)
            if hit is None:  # keep the source alive so its id is not reused this call
                hit = self._copies[key] = (obj, obj.to(device))
            return hit[1]
        if isinstance(obj, tuple | list):
            return type(obj)(self.move(item, device) for item in obj)
        if isinstance(obj, dict):
            return {key: self.move(value, device) for key, value in obj.items()}
        return obj


class _Walk:
    """One call's walk through one shard: where it is, what it holds, what it moved."""

    def __init__(
        self, shard: Shard, plan: CallPlan, on_block: OnBlock | None = None, rank: Rank | None = None
    ) -> None:
        self.shard, self.plan, self.on_block, self.rank = shard, plan, on_block, rank
        self.moves = TransferCache()
        self.stage: int | None = None
        self.paths: set[str] = set()  # how its blocks ran: compiled, padded, eager
        self.whole_shared: dict[str, Any] | None = None  # set while the flow is this rank's slice
        self.home: int | None = None  # the thread's current CUDA device before the walk moved it
        self.fences: dict[str, torch.cuda.Event] = {}  # `CallResult.fences`

    @staticmethod
    def rows(adapters: Sequence[Any]) -> AdapterRows | None:
        """The adapter rows of the rows flowing (all of the call's, or the refreshing ones)."""
        return AdapterRows(tuple(adapters)) if any(adapters) else None

    def block(self, name: str, flow: Flow, rows: AdapterRows | None) -> Flow:
        """Run block `name` on `flow`: in its stage (gate taken, flow moved), compiled if it can."""
        shard = self.shard
        stage = shard.stage_of[name]
        device = shard.stage_devices[stage]
        split = self.rank is not None and name in self.rank.split.blocks
        if not split:
            flow = self.whole(flow)
        # a boundary's copy is queued while the stage before is still this call's (its gate held),
        # never behind the next call's kernels there
        flow = Flow(self.moves.move(flow.rows, device), self.moves.move(flow.shared, device))
        if stage != self.stage:
            self.leave()
            shard.gates.enter(stage)
            self.stage = stage
            self.set_device(device)
        if split and self.whole_shared is None:
            self.whole_shared = flow.shared
            flow = self.rank.cut(flow)
        call: BlockCall = shard.calls[name]
        if call.needs is not None and call.needs not in flow.rows:
            return flow  # nothing to do (nothing to compile)
        if self.on_block is not None:
            self.on_block(name, flow)
        shard.slots[stage].rows = rows
        out = None
        if self.plan.compiled and shard.compiled is not None and rows is None and not split:
            out, path = shard.compiled.block(name, call, flow)
            self.paths.add(path)
        elif shard.compiled is not None:
            self.paths.add("eager")
        if out is None and split:
            with self.rank.attention(name):
                out = call.fn(call.owner, flow.rows, flow.shared)
        elif out is None:
            out = call.fn(call.owner, flow.rows, flow.shared)
        return Flow(out, flow.shared)

    def whole(self, flow: Flow) -> Flow:
        """The flow with every token: as is, or (a rank's slice) gathered from every rank."""
        if self.whole_shared is None:
            return flow
        flow, self.whole_shared = self.rank.join(flow, self.whole_shared), None
        return flow

    def agree(self, outcomes: list[Outcome]) -> None:
        """Every rank refreshes the rows rank 0 decided to (ranks must run the same blocks)."""
        if self.rank is not None:
            decided = self.rank.agree([o.refreshed for o in outcomes])
            for outcome, refreshed in zip(outcomes, decided, strict=True):
                outcome.refreshed = refreshed

    def set_device(self, device: torch.device) -> None:
        """A stage's work runs with its GPU as this thread's current device (`walk` puts the
        thread's own back): its handles, workspaces and default stream are that GPU's."""
        if device.type == "cuda":
            if self.home is None:
                self.home = torch.cuda.current_device()
            torch.cuda.set_device(device)

    def leave(self) -> None:
        if self.stage is not None:
            self.shard.slots[self.stage].rows = None
            device = self.shard.stage_devices[self.stage]
            if device.type == "cuda":  # this call's work there ends here, the next call's may follow
                self.fences[str(device)] = fence = torch.cuda.Event()
                fence.record()
            self.shard.gates.leave(self.stage)
            self.stage = None


def walk(
    shard: Shard,
    inputs: DenoiserInputs,
    plan: CallPlan,
    on_block: OnBlock | None = None,
    rank: Rank | None = None,
) -> CallResult:
    """One call of `plan` on `inputs` through `shard` (see the module's doc); `on_block(name,
    flow)` sees each block's inputs (what warming compiles from: such a walk is not counted);
    `rank`: this walk is one rank of a sequence group."""
    rows = inputs.sample.shape[0]
    if plan.rows != rows:
        raise ValueError(f"the call plan is for {plan.rows} rows, the inputs have {rows}")
    state = _Walk(shard, plan, on_block, rank)
    shard.gates.begin()
    try:
        whole_graph = plan.compiled and not plan.cached and not any(plan.adapters) and rank is None
        if shard.compiled is not None and whole_graph:
            whole = shard.compiled.whole(inputs, plan.counted)  # --compile full: one graph for the call
            if whole is not None:
                return CallResult(whole, [Outcome() for _ in plan.groups])
        out, outcomes = _blocks(state, inputs)
        if shard.compiled is not None and on_block is None and plan.counted:
            shard.compiled.count(state.paths)
        # the last stage's fence is recorded as `finally` leaves it, after this copy is queued
        return CallResult(out.to(shard.device), outcomes, fences=state.fences)
    finally:
        state.leave()
        shard.gates.end()
        if state.home is not None:
            torch.cuda.set_device(state.home)


def _blocks(state: _Walk, inputs: DenoiserInputs) -> tuple[torch.Tensor, list[Outcome]]:
    shard, plan = state.shard, state.plan
    moved = DenoiserInputs(*(state.moves.move(x, shard.device) for x in vars(inputs).values()))
    flow = shard.spec.begin(shard.model, moved)
    boundary = shard.boundary if plan.cached else None
    outcomes = [Outcome() for _ in plan.groups]
    everyone = state.rows(plan.adapters)
    names = shard.layout.names
    index = 0
    while index < len(names):
        name = names[index]
        if boundary is not None and name == boundary.deep[0]:
            flow = _deep(state, state.whole(flow), boundary, outcomes)
            index = names.index(boundary.deep[1]) + 1
            continue
        before = flow.rows.get(boundary.carry) if boundary is not None and name == boundary.first else None
        flow = state.block(name, flow, everyone)
        if before is not None:
            flow = state.whole(flow)
            _decide(plan, outcomes, flow.rows[boundary.carry] - before.to(flow.rows[boundary.carry].device))
            state.agree(outcomes)
        if shard.boundary is not None and name == shard.boundary.deep[1]:  # as a cached walk leaves it
            flow = _after_deep(flow, shard.boundary)
        index += 1
    flow = state.whole(flow)
    if hasattr(shard.spec, "held"):  # what the rows keep beside their inputs (Qwen-Image 2.1's prefix)
        held = shard.spec.held(shard.model, flow)
        for outcome, rows in zip(outcomes, plan.spans, strict=True):
            outcome.held = {name: value[rows] for name, value in held.items()}
    return shard.spec.end(shard.model, flow, moved), outcomes


def _change(now: torch.Tensor, before: torch.Tensor) -> float:
    """Relative mean absolute change of a residual since the last refresh."""
    return float((now - before).abs().mean() / before.abs().mean().clamp_min(1e-12))


def _decide(plan: CallPlan, outcomes: list[Outcome], residual: torch.Tensor) -> None:
    """After the first block: each cached group refreshes when asked, when it has nothing kept,
    or when its first-block residual moved by its threshold or more; a refreshing one keeps it."""
    for group, outcome, rows in zip(plan.groups, outcomes, plan.spans, strict=True):
        ask = group.cache
        if ask is None:
            continue
        if ask.kept is None or "first" not in ask.kept:
            outcome.refreshed = True
        elif ask.refresh is None:
            outcome.refreshed = (
                _change(residual[rows], ask.kept["first"].to(residual.device)) >= ask.threshold
            )
        else:
            outcome.refreshed = ask.refresh
        if outcome.refreshed:
            outcome.fresh["first"] = residual[rows]


def _deep(state: _Walk, flow: Flow, boundary: CacheBoundary, outcomes: list[Outcome]) -> Flow:
    """The deep blocks, on the refreshing rows only; every row's carry after them: the fresh one,
    or what the row kept (its output, or its residual added to the carry)."""
    plan, names = state.plan, state.shard.layout.names
    spans = plan.spans
    for group, outcome in zip(plan.groups, outcomes, strict=True):
        ask = group.cache
        if boundary.first is None and ask is not None:  # no first block to decide by: as asked
            outcome.refreshed = ask.kept is None or ask.refresh is not False
    refreshing = [
        r for o, s in zip(outcomes, spans, strict=True) if o.refreshed for r in range(s.start, s.stop)
    ]
    deep = names[names.index(boundary.deep[0]) : names.index(boundary.deep[1]) + 1]
    carried = boundary.carried
    carry = flow.rows[boundary.carry]
    sub, fresh, made = flow, None, None
    if refreshing:
        everyone = len(refreshing) == plan.rows
        if not everyone:
            sub = flow.select(host_values(refreshing, carry.device))
        rows = state.rows([plan.adapters[r] for r in refreshing])
        start = {key: sub.rows[key] for key in carried}
        for name in deep:
            sub = state.block(name, sub, rows)
        sub = state.whole(sub)
        fresh = made = {key: sub.rows[key] for key in carried}
        if boundary.keep == "residual":
            fresh = {key: made[key] - start[key].to(made[key].device) for key in carried}
        if everyone:  # every row ran every block: the flow as is (no assembly, bit-exact)
            for key in carried:
                _keep(plan, outcomes, spans, fresh[key], _kept_name(boundary, key))
            return _after_deep(sub, boundary)
    rows = dict(flow.rows)
    for key in carried:
        whole = flow.rows[key]
        device = whole.device if fresh is None else fresh[key].device
        pieces = _keep(
            plan, outcomes, spans, None if fresh is None else fresh[key], _kept_name(boundary, key)
        )
        if boundary.keep == "residual":
            pieces = _add_kept(outcomes, spans, pieces, whole.to(device), None if made is None else made[key])
        rows[key] = torch.cat([p.to(device) for p in pieces])
    if boundary.stack is not None:  # a stack the deep blocks pop: what they leave of it
        key, left = boundary.stack
        rows[key] = rows[key][:left]
    return _after_deep(Flow(rows, flow.shared), boundary)


def _kept_name(boundary: CacheBoundary, key: str) -> str:
    """What a row keeps of carried stream `key`: "deep" for `carry`, "deep.KEY" for the others."""
    return "deep" if key == boundary.carry else f"deep.{key}"


def _after_deep(flow: Flow, boundary: CacheBoundary) -> Flow:
    """The flow after the deep blocks holds what the blocks after them read (`boundary.after`),
    whichever way it got there: so those blocks see one signature (one compiled graph)."""
    if boundary.after is None:
        return flow
    return Flow({key: flow.rows[key] for key in boundary.after if key in flow.rows}, flow.shared)


def _add_kept(
    outcomes: list[Outcome],
    spans: list[slice],
    residuals: list[torch.Tensor],
    carry: torch.Tensor,
    made: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Each group's carry after the deep blocks: a reusing row's carry plus the residual it kept; a
    refreshing row's, what the deep blocks made of it as is. `carry + (made - carry)` is `made`
    only to a rounding, and on int8-dynamic weights a rounding in the next step's input flips an
    activation's int8 step: the row would differ from itself stepped alone, or beside no reuser."""
    pieces, at = [], 0
    for outcome, rows, residual in zip(outcomes, spans, residuals, strict=True):
        if outcome.refreshed:
            count = rows.stop - rows.start
            pieces.append(made[at : at + count])
            at += count
        else:
            pieces.append(carry[rows] + residual.to(carry.device))
    return pieces


def _keep(
    plan: CallPlan,
    outcomes: list[Outcome],
    spans: list[slice],
    fresh: torch.Tensor | None,
    name: str,
) -> list[torch.Tensor]:
    """Each group's piece of a carried stream: its slice of `fresh` (kept as `name`) or what it kept."""
    pieces, at = [], 0
    for group, outcome, rows in zip(plan.groups, outcomes, spans, strict=True):
        count = rows.stop - rows.start
        if outcome.refreshed:
            piece = fresh[at : at + count]
            at += count
            if group.cache is not None:
                outcome.fresh[name] = piece
        else:
            piece = group.cache.kept[name]
        pieces.append(piece)
    return pieces


__all__ = ["TransferCache", "walk"]
