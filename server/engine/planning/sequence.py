"""The planner's third axis: a sequence group's step, predicted from counted costs plus the
bytes its exchanges move (`runtime/sequence.py` runs it).

A group of D ranks runs each split block on 1/D of the tokens: every op of a DiT block is per
token, and attention over S/D queries and all S keys is 1/D of the whole too, so a split block
costs its seconds / D. On top, per split block, Ulysses' two all-to-alls: a rank keeps 1/D of
its queries, keys and values and of the output and exchanges the rest, 4 · (D-1)/D² of the
block's tokens; and where the split blocks end, a gather of (D-1)/D of them. The tokens' bytes
are half of what the block reads and writes (its tokens in, its tokens out: the meta trace's
`block_io_bytes`). Each exchange also waits for the slowest rank: `Link.sync_s`.

Links: a GPU's to its peers is its profile's (NVLink or PCIe, `gpus.py`; not measured); CPU
ranks copy through memory, at half the calibrated streaming rate (a copy reads and writes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from torch import nn

from server.engine.denoisers.specs import spec_for
from server.engine.hardware.gpus import LINK_SHARE, gpu_profile
from server.engine.planning.flow import trace_flow
from server.engine.planning.plan import ShardPlan

# Seconds one exchange waits beyond its copies: a barrier round trip between threads, a
# cross-device synchronization on GPUs. An estimate; `benchmarks.parallel.sequence` prints the measured.
EXCHANGE_SYNC_S = 50e-6


@dataclass(frozen=True)
class Link:
    """How fast a rank gets its peers' tensors: bytes per second, and seconds per exchange."""

    bytes_per_s: float
    sync_s: float = EXCHANGE_SYNC_S


# GPUs that cannot reach each other's memory (no P2P: GeForce cards, many VMs) copy through the
# host: down over PCIe into pinned memory, then up again, each hop at best a Gen4 x16 link's rate.
HOST_STAGED_GB_S = 32.0 / 2


def gpu_link(profile: str | None, peers: bool = True) -> Link:
    """A GPU's link to its peers: the profile's, or host-staged without peer access."""
    rate = gpu_profile(profile).link_gb_s if peers else min(gpu_profile(profile).link_gb_s, HOST_STAGED_GB_S)
    return Link(rate * 1e9 * LINK_SHARE)


def cpu_link(streaming_bytes_per_s: float) -> Link:
    return Link(streaming_bytes_per_s / 2)


def split_blocks(model: nn.Module) -> frozenset[str]:
    """The blocks a sequence group may split (none for a UNet)."""
    split = spec_for(model).sequence(model)
    return split.blocks if split is not None else frozenset()


def group_step_s(
    plan: ShardPlan,
    costs: Mapping[str, float],
    degree: int,
    blocks: frozenset[str],
    io_bytes: Mapping[str, int],
    share: float,
    link: Link,
) -> tuple[float, float]:
    """Seconds of one step through `plan` as a group of `degree` ranks, and the exchanges' part
    of them. `costs`: seconds per block on one rank at the step's rows; `io_bytes`: each block's
    bytes in and out as traced for the plan, scaled by `share` to the step's rows and size."""
    compute = exchange = 0.0
    open_tokens = 0.0  # the tokens of the last split block, while the flow is split

    def gather() -> float:
        return open_tokens * (degree - 1) / degree / link.bytes_per_s + link.sync_s

    for stage in plan.stages:
        for block in stage.blocks:
            if block in blocks:
                tokens = io_bytes.get(block, 0) * share / 2
                compute += costs[block] / degree
                exchange += 4 * tokens * (degree - 1) / degree**2 / link.bytes_per_s + 2 * link.sync_s
                open_tokens = tokens
            else:
                if open_tokens:
                    exchange += gather()
                    open_tokens = 0.0
                compute += costs[block]
    if open_tokens:
        exchange += gather()
    return compute + exchange, exchange


class GroupSteps:
    """The planner's search (`planner._Search`), its groups' steps: a sequence group's, and the
    costing both kinds of group share. Reads the search's model, costs, links and sharing."""

    def _group_s(self, plan: ShardPlan, threads: int, rows: int, degree: int) -> float:
        """Seconds of one step of `rows` rows as a sequence group of `degree` ranks."""
        step = partial(group_step_s, blocks=self.split)
        return self._ranks_s(plan, threads, rows, degree, step) * self._stretch(degree, threads)

    def _ranks_s(self, plan: ShardPlan, threads: int, rows: int, degree: int, step: Callable) -> float:
        """Seconds of one step of `rows` rows through a rank's `plan` in a group of `degree`, as
        `step` predicts it from the blocks' costs, their traced bytes and the step's share of them."""
        device = plan.stages[0].device
        costs = self.block_costs(device, threads, rows=rows, **self._sharing(degree, threads))
        flow = trace_flow(self.model, plan.batch, plan.latent_size, self.dtype)
        share = rows / plan.batch * (self.latent / plan.latent_size) ** 2
        seconds, _ = step(
            plan, costs, degree, io_bytes=flow.block_io_bytes, share=share, link=self.links(device, threads)
        )
        return seconds
