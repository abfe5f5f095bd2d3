"""The planner's tensor axis: a tensor group's step, predicted from counted costs plus the bytes
its all-reduces move (`runtime/tensor.py` runs it).

A group of T ranks runs each split block with 1/T of its heads and MLP features: its matmuls and
attention are 1/T each, so a split block costs its seconds times the share of its weights a rank
holds (`tensor_shares`: ≈ 1/T for a DiT block, whose norms are a sliver of it; most of a UNet
block, whose convolutions run whole on every rank). On top, per split block, two all-reduces
(the attention's output, the MLP's) of the block's tokens: a ring all-reduce moves 2 · (T-1)/T
of them per rank, and each waits for the slowest rank (`Link.sync_s`). The tokens' bytes are half
of what the block reads and writes (the meta trace's `block_io_bytes`), as for sequence groups.
Blocks that do not split run whole on every rank at once (no faster than one device). The links
are the sequence groups' (`Link`).
"""

from __future__ import annotations

from collections.abc import Mapping

from server.engine.planning.plan import ShardPlan
from server.engine.planning.sequence import Link

REDUCES_PER_BLOCK = 2  # the attention's output projection and the MLP's second one


def tensor_step_s(
    plan: ShardPlan,
    costs: Mapping[str, float],
    degree: int,
    shares: Mapping[str, float],
    io_bytes: Mapping[str, int],
    share: float,
    link: Link,
) -> tuple[float, float]:
    """Seconds of one step through a rank's `plan` as a tensor group of `degree` ranks, and the
    exchanges' part of them (`shares`: the split blocks' part a rank holds; `costs`, `io_bytes`,
    `share`: as `sequence.group_step_s` takes them)."""
    compute = exchange = 0.0
    for stage in plan.stages:
        for block in stage.blocks:
            if block in shares:
                tokens = io_bytes.get(block, 0) * share / 2
                compute += costs[block] * shares[block]
                ring = 2 * tokens * (degree - 1) / degree / link.bytes_per_s
                exchange += REDUCES_PER_BLOCK * (ring + link.sync_s)
            else:
                compute += costs[block]
    return compute + exchange, exchange
