"""A step's denoiser call with step caching: each request's rows refresh or reuse what they kept
(`stepcache.py` has the policies, `server/engine/stepcache.py` the walks)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from server.engine import ModelShard
from server.engine.blocks import DenoiserInputs
from server.engine.stepcache import RowGroup
from server.pipeline.adapters import Choice, rows_asking
from server.pipeline.state import RequestState, spans


def cached_forward(
    shard: ModelShard, states: Sequence[RequestState], inputs: DenoiserInputs, asking: Sequence[Choice]
) -> torch.Tensor | None:
    """The denoiser's output for `states`' rows, each request refreshing or reusing by its policy;
    None when none asks for caching or the model cannot walk these inputs (then every row runs the
    plain forward, as without caching). `asking` is each row's adapters."""
    for state in states:
        state.cache.last = None
    if not any(s.request.step_cache.on for s in states):
        return None
    groups = [_group(state, span) for state, span in zip(states, spans(states), strict=True)]

    def subset(rows: list[int]) -> AbstractContextManager[None]:
        return rows_asking([asking[row] for row in rows])

    out = shard.cached(inputs, groups, subset)
    if out is None:
        return None
    for state, group in zip(states, groups, strict=True):
        cache = state.cache
        if not state.request.step_cache.on:
            continue  # refreshed, as without caching: nothing to keep or count
        cache.last = "refreshed" if group.refresh else "reused"
        if not group.refresh:
            cache.reused += 1
            continue
        cache.refreshed += 1
        cache.refreshed_at = state.index
        for name, fresh in group.fresh.items():  # into buffers the request's scope rents, once
            if name not in cache.kept:
                cache.kept[name] = state.scope.rent(fresh.shape, fresh.dtype, fresh.device)
            cache.kept[name].copy_(fresh)
    return out


def _group(state: RequestState, rows: slice) -> RowGroup:
    policy, cache = state.request.step_cache, state.cache
    kept = cache.kept or None
    if policy.policy == "deep":
        due = kept is None or state.index - cache.refreshed_at >= policy.interval
        return RowGroup(rows, kept, refresh=due)
    if policy.policy == "first_block":  # the walk decides by the threshold once something is kept
        return RowGroup(rows, kept, refresh=kept is None, threshold=policy.threshold)
    return RowGroup(rows, None)  # off: refreshes every step, keeps nothing
