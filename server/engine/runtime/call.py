"""A call plan: everything one denoiser call carries besides its tensors, as one immutable value.

A call's rows come in groups, one per request: its adapters with their scales, what step
caching asks of it (refresh, reuse, or decide by the threshold) and what it kept, whether it is
deterministic. The block walker (`walker.py`) reads the plan; a micro-batch gets its part by
`split`. Nothing about a call lives anywhere else (no thread-locals), so every feature composes
with every other: a row with adapters splits over idle replicas like any other, a cached row
runs compiled blocks where a bucket fits.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from server.engine.hardware.devices import host_values

Choice = tuple[tuple[str, float], ...]  # a request's adapters: (name, scale), in order


@dataclass(frozen=True)
class CacheAsk:
    """What step caching asks of a group's rows this call."""

    kept: Mapping[str, torch.Tensor] | None = None  # its features from the last refresh (None: refresh)
    refresh: bool | None = True  # True / False: decided; None: by `threshold` after the first block
    threshold: float = 0.0  # relative change of the first block's residual that forces a refresh


@dataclass(frozen=True)
class RowGroup:
    """One request's rows in a call."""

    rows: int
    adapters: Choice = ()
    cache: CacheAsk | None = None  # None: not cached (every block runs; nothing kept)
    deterministic: bool = False  # its rows' shapes must not depend on what else runs

    def cut(self, start: int, stop: int) -> RowGroup:
        """Rows [start, stop) of this group (its kept features cut alike)."""
        cache = self.cache
        if cache is not None and cache.kept is not None:
            kept = {name: value[start:stop] for name, value in cache.kept.items()}
            cache = replace(cache, kept=kept)
        return replace(self, rows=stop - start, cache=cache)


@dataclass(frozen=True)
class CallPlan:
    groups: tuple[RowGroup, ...]
    compiled: bool = True  # compiled graphs may run it (False: every block eagerly)
    counted: bool = True  # in the service's compiled-call counts (a measurement's call: False)

    @classmethod
    def plain(cls, rows: int) -> CallPlan:
        """`rows` rows of nothing in particular: no adapters, no caching."""
        return cls((RowGroup(rows),))

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def adapters(self) -> tuple[Choice, ...]:
        """Each row's adapters."""
        return tuple(g.adapters for g in self.groups for _ in range(g.rows))

    @property
    def spans(self) -> list[slice]:
        """Each group's rows in the call."""
        ends = list(itertools.accumulate(g.rows for g in self.groups))
        return [slice(end - g.rows, end) for g, end in zip(self.groups, ends, strict=True)]

    @property
    def cached(self) -> bool:
        return any(g.cache is not None for g in self.groups)

    @property
    def splittable(self) -> bool:
        """Its rows may be cut over replicas: no deterministic group."""
        return not any(g.deterministic for g in self.groups)

    def split(self, parts: int) -> list[CallPlan]:
        """The plan cut into at most `parts` plans of consecutive rows, as `split_rows` cuts the
        tensors. A group deciding by threshold is never cut (its rows decide together)."""
        bounds = [int(b[0]) for b in torch.arange(self.rows).tensor_split(min(parts, self.rows))]
        edges, at = set(), 0
        for g in self.groups:  # where a threshold group lies, a cut moves to its start
            if g.cache is not None and g.cache.refresh is None:
                edges.update(range(at + 1, at + g.rows))
            at += g.rows
        cuts = sorted({next(s for s in range(b, -1, -1) if s not in edges) for b in bounds} | {self.rows})
        return [self.rows_between(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def rows_between(self, start: int, stop: int) -> CallPlan:
        groups, at = [], 0
        for g in self.groups:
            lo, hi = max(start, at), min(stop, at + g.rows)
            if lo < hi:
                groups.append(g if (lo, hi) == (at, at + g.rows) else g.cut(lo - at, hi - at))
            at += g.rows
        return replace(self, groups=tuple(groups))


@dataclass
class Outcome:
    """What happened to one group: refreshed (every block ran; `fresh` holds what to keep) or
    reused its kept features."""

    refreshed: bool = True
    fresh: dict[str, torch.Tensor] = field(default_factory=dict)
    # what the denoiser's spec hands its rows to keep beside their inputs (`held`: Qwen-Image
    # 2.1's prefix keys and values after a request's first call)
    held: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class CallResult:
    out: torch.Tensor
    outcomes: list[Outcome]  # one per group of the plan
    exchange_s: float = 0.0  # a sequence group's seconds in exchanges (rank 0's: waits and copies)
    # a CUDA event per GPU stage the call left, recorded as it left (before its gate was free):
    # the end of this call's work there; what is queued after is the next call's
    fences: dict[str, torch.cuda.Event] = field(default_factory=dict)

    @staticmethod
    def joined(
        parts: Sequence[tuple[CallPlan, CallResult]], plan: CallPlan, device: torch.device
    ) -> CallResult:
        """The micro-batches' results as the whole plan's: outputs concatenated, a cut group's
        outcome put back together."""
        out = torch.cat([r.out.to(device) for _, r in parts])
        pieces = [o for _, r in parts for o in r.outcomes]
        sizes = [g.rows for p, _ in parts for g in p.groups]
        outcomes, at = [], 0
        for group in plan.groups:
            taken, rows = [], 0
            while rows < group.rows:
                taken.append(pieces[at])
                rows += sizes[at]
                at += 1
            fresh = (
                {name: torch.cat([o.fresh[name].to(device) for o in taken]) for name in taken[0].fresh}
                if len(taken) > 1
                else taken[0].fresh
            )
            held = (
                {name: _padded_cat([o.held[name].to(device) for o in taken]) for name in taken[0].held}
                if len(taken) > 1
                else taken[0].held
            )
            outcomes.append(Outcome(taken[0].refreshed, fresh, held))
        return CallResult(out, outcomes, fences={d: e for _, r in parts for d, e in r.fences.items()})


def _padded_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows of a group cut over micro-batches, joined: what each held, zero-padded to the largest
    (a held prefix is padded per call; its zeros are masked out)."""
    shape = [max(sizes) for sizes in zip(*(p.shape for p in parts), strict=True)]
    padded = []
    for p in parts:
        pairs = zip(reversed(p.shape[1:]), reversed(shape[1:]), strict=True)
        padded.append(torch.nn.functional.pad(p, [w for have, want in pairs for w in (0, want - have)]))
    return torch.cat(padded)


class AdapterRows:
    """Which rows of the call flowing through a stage ask for which adapter, at what scale. Per
    set of adapters a layer holds, a mask [rows, their ranks stacked] of each row's scale, made
    once per call and device (not once per layer)."""

    def __init__(self, rows: tuple[Choice, ...]) -> None:
        self.rows = rows
        self._masks: dict[tuple, torch.Tensor | None] = {}

    def mask(
        self, names: tuple[str, ...], ranks: tuple[int, ...], device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """[rows, sum of ranks]: a row's scale for each adapter's columns (0: not asked); None if
        no row asks for any of `names`."""
        key = (names, ranks, device, dtype)
        if key not in self._masks:
            scales = [dict(choice) for choice in self.rows]
            per_column = [
                [s.get(n, 0.0) for n, r in zip(names, ranks, strict=True) for _ in range(r)] for s in scales
            ]
            asked = any(n in s for s in scales for n in names)
            self._masks[key] = host_values(per_column, device, dtype) if asked else None
        return self._masks[key]


class RowsSlot:
    """Where the call holding a stage (or a text encoder) leaves its `AdapterRows` for the
    adapter hooks on that stage's layers: a stage runs one call at a time (its gate), so the
    slot always holds the rows of the call its layers are running."""

    rows: AdapterRows | None = None
