"""Step caching between a request's state and a call plan: what each request asks of the call
this step (`cache_ask`), and what its rows keep after (`keep`, into the state's `RowCache`). The
policies a request asks for are in `server/requests/step_cache.py`; the block walker
(`server/engine/runtime/walker.py`) splits the rows at the spec's cache boundary."""

from __future__ import annotations

from server.engine.runtime.call import CacheAsk, Outcome
from server.pipeline.steps.state import RequestState


def cache_ask(state: RequestState) -> CacheAsk | None:
    """This step's ask of `state`'s rows: None when its request caches nothing."""
    policy, cache = state.request.step_cache, state.cache
    if not policy.on:
        return None
    kept = cache.kept or None
    if cache.expert != state.expert:  # crossed to another expert: what it kept is the other's
        return CacheAsk(kept, refresh=True)
    if policy.policy == "deep":
        due = kept is None or state.index - cache.refreshed_at >= policy.interval
        return CacheAsk(kept, refresh=due)
    # first_block: the walker decides by the threshold once something is kept
    return CacheAsk(kept, refresh=None if kept else True, threshold=policy.threshold)


def keep(state: RequestState, outcome: Outcome) -> None:
    """Count the step and keep what a refresh made, in buffers the request's scope rents (once)."""
    cache = state.cache
    cache.last = None
    if not state.request.step_cache.on or (outcome.refreshed and not outcome.fresh):
        return  # not cached (or the denoiser has no cache boundary): nothing to keep or count
    cache.last = "refreshed" if outcome.refreshed else "reused"
    if not outcome.refreshed:
        cache.reused += 1
        return
    cache.refreshed += 1
    cache.refreshed_at, cache.expert = state.index, state.expert
    for name, fresh in outcome.fresh.items():
        if name not in cache.kept:
            cache.kept[name] = state.scope.rent(fresh.shape, fresh.dtype, fresh.device)
        cache.kept[name].copy_(fresh)


def hold(state: RequestState, outcome: Outcome) -> None:
    """What the denoiser handed a request's rows to keep (`Outcome.held`) joins their inputs, in
    buffers its scope rents: Qwen-Image 2.1's prefix keys and values, from its first call on."""
    for name, value in outcome.held.items():
        kept = state.extras.get(name)
        if kept is None or kept.shape != value.shape:
            kept = state.extras[name] = state.scope.rent(value.shape, value.dtype, state.latents.device)
        kept.copy_(value)
