"""Step caching as a request asks for it: a policy and its parameter, parsed from the wire
(`parse_step_cache`) or from `--step-cache`.

Two policies, each a few lines of the papers' idea around per-row state (their code assumes one
request per forward, so none is vendored):

- `deep` (UNets; DeepCache, Ma et al. 2023, arXiv:2312.00858): a row refreshes every `interval`
  steps, running the whole UNet and keeping what its second-to-last up block made; between
  refreshes it runs only the shallow blocks (conv_in, the first down block, the last up block)
  on the kept features.
- `first_block` (DiTs; First-Block-Cache as in ParaAttention and cache-dit's DBCache F1B0): every
  step runs the first transformer block; a row whose first-block residual changed by less than
  `threshold` (relative mean absolute change since its last refresh) skips the other blocks and
  adds the residual they made at its last refresh.

What a row keeps between steps is the pipeline's (`steps/caching.py`); the block walker
(`server/engine/runtime/walker.py`) splits each step's rows at the spec's cache boundary
(`CacheBoundary`): refreshing rows run the deep part, reusing rows do not, in one call.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from server.errors import InvalidRequest

POLICIES = ("off", "deep", "first_block")
MAX_INTERVAL = 10  # DeepCache's quality falls off past ~5; 10 is the most anyone should ask
DEFAULT_INTERVAL = 3
DEFAULT_THRESHOLD = 0.08


@dataclass(frozen=True)
class StepCache:
    """A request's step-caching policy and its parameter (the other one is unused)."""

    policy: str = "off"
    interval: int = DEFAULT_INTERVAL  # deep: a row refreshes every `interval` steps
    threshold: float = DEFAULT_THRESHOLD  # first_block: reuse while the change stays below it

    @property
    def on(self) -> bool:
        return self.policy != "off"

    def wire(self) -> str | dict[str, Any]:
        """As a request sends it: the policy's name at its default parameter, else its object."""
        if self.policy == "deep" and self.interval != DEFAULT_INTERVAL:
            return {"policy": "deep", "interval": self.interval}
        if self.policy == "first_block" and self.threshold != DEFAULT_THRESHOLD:
            return {"policy": "first_block", "threshold": self.threshold}
        return self.policy

    def __str__(self) -> str:
        if self.policy == "deep":
            return f"deep (interval {self.interval})"
        if self.policy == "first_block":
            return f"first_block (threshold {self.threshold:g})"
        return "off"


OFF = StepCache()


def parse_step_cache(value: Any, name: str = "step_cache") -> StepCache:
    """A StepCache from the wire: "off", a policy's name (its default parameters), an object
    `{"policy": ..., "interval"|"threshold": ...}`, or that object as JSON text (the
    `--step-cache` setting). Raises InvalidRequest naming `name` and the limit broken."""
    if isinstance(value, StepCache):
        return value
    if value is None:
        return OFF
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise InvalidRequest(name, f"is not valid JSON: {err.msg}") from None
    if isinstance(value, str):
        value = {"policy": value.strip()}
    if not isinstance(value, dict):
        raise InvalidRequest(name, f'must be "off", a policy name or an object, got {type(value).__name__}')
    policy = value.get("policy")
    if policy not in POLICIES:
        raise InvalidRequest(f"{name}.policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    allowed = {"policy", *{"deep": ("interval",), "first_block": ("threshold",), "off": ()}[policy]}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise InvalidRequest(f"{name}.{unknown[0]}", f"is not a parameter of the {policy!r} policy")
    interval = value.get("interval", DEFAULT_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= MAX_INTERVAL:
        limit = f"must be an integer from 1 to {MAX_INTERVAL}, got {interval!r}"
        raise InvalidRequest(f"{name}.interval", limit)
    threshold = value.get("threshold", DEFAULT_THRESHOLD)
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not (math.isfinite(threshold) and 0 <= threshold <= 1)
    ):
        raise InvalidRequest(f"{name}.threshold", f"must be a number from 0 to 1, got {threshold!r}")
    return StepCache(policy, int(interval), float(threshold))
