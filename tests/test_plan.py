"""Shard plans: properties of every strategy, budgets, and errors that say what to fix."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine import CostModel, DeviceError, PlanError, layout_of, plan_shards
from server.engine.hardware.devices import parse_size
from server.engine.planning.partition import min_max_partition
from tests.conftest import tiny_sd15_unet, tiny_sdxl_unet

SD15 = tiny_sd15_unet()
SDXL = tiny_sdxl_unet()
models = st.sampled_from([SD15, SDXL])
few = settings(max_examples=25, deadline=None)


def assert_well_formed(plan, model) -> None:
    """Every block in exactly one stage; stages contiguous runs in execution order."""
    assert plan.blocks == layout_of(model).names
    assert all(stage.blocks for stage in plan.stages)
    assert len(plan.boundaries) == len(plan.stages) - 1


@few
@given(model=models, n_devices=st.integers(1, 12))
def test_even_never_leaves_a_device_empty(model, n_devices: int) -> None:
    plan = plan_shards(model, ["cpu"] * n_devices, "even")
    assert_well_formed(plan, model)
    n_blocks = len(plan.blocks)
    assert len(plan.stages) == min(n_devices, n_blocks)
    sizes = [len(stage.blocks) for stage in plan.stages]
    assert max(sizes) - min(sizes) <= 1


@few
@given(model=models, n_devices=st.integers(1, 6))
def test_memory_is_within_one_block_of_the_ideal_split(model, n_devices: int) -> None:
    plan = plan_shards(model, ["cpu"] * n_devices, "memory")
    assert_well_formed(plan, model)
    block_bytes = [b for stage in plan.stages for b in stage.block_bytes]
    heaviest = max(stage.param_bytes for stage in plan.stages)
    assert heaviest <= sum(block_bytes) / n_devices + max(block_bytes)


@few
@given(model=models, n_devices=st.integers(1, 4), budget_kib=st.integers(100, 20_000))
def test_budgets_hold_or_the_plan_is_refused(model, n_devices: int, budget_kib: int) -> None:
    budget = budget_kib * 1024
    try:
        plan = plan_shards(model, ["cpu"] * n_devices, "memory", max_memory={"cpu": budget})
    except PlanError as err:
        assert "cpu" in str(err) and "short" in str(err)
        return
    assert_well_formed(plan, model)
    (cpu,) = plan.devices
    assert cpu.param_bytes + cpu.activation_reserve <= budget


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(1, 1000), min_size=1, max_size=9),
    caps=st.lists(st.one_of(st.just(math.inf), st.integers(0, 3000)), min_size=1, max_size=4),
)
def test_partition_minimises_the_heaviest_run(weights: list[int], caps: list[float]) -> None:
    """Against brute force over every contiguous split (runs may be empty)."""
    best = math.inf
    n = len(weights)
    for cuts in itertools.combinations_with_replacement(range(n + 1), len(caps) - 1):
        bounds = [0, *cuts, n]
        loads = [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]
        if all(load <= cap for load, cap in zip(loads, caps, strict=True)):
            best = min(best, max(loads))
    lengths = min_max_partition([weights] * len(caps), weights, caps)
    if best == math.inf:
        assert lengths is None
        return
    assert lengths is not None and sum(lengths) == n
    starts = list(itertools.accumulate([0, *lengths]))
    loads = [sum(weights[a:b]) for a, b in itertools.pairwise(starts)]
    assert max(loads) == best
    assert all(load <= cap for load, cap in zip(loads, caps, strict=True))


def test_cost_balances_given_block_costs() -> None:
    names = layout_of(SD15).names
    costs = {name: 1.0 for name in names} | {"up_blocks.2": 6.0}  # one block dominates
    plan = plan_shards(SD15, "cpu,cpu", "cost", block_costs=costs)
    assert_well_formed(plan, SD15)
    # 15 s in all; the best split keeps up_blocks.2 with at most one 1 s neighbour: 8 + 7
    assert sorted(stage.cost_s for stage in plan.stages) == [7.0, 8.0]


def test_cost_takes_counted_costs_per_device_and_never_times_blocks_itself() -> None:
    counted = CostModel(SD15, 2, 8, torch.float32)
    plan = plan_shards(
        SD15, "cpu,cpu", "cost", latent_size=8, block_costs=lambda device: counted.costs(device)
    )
    assert all(stage.cost_s is not None and stage.cost_s > 0 for stage in plan.stages)
    with pytest.raises(PlanError, match="the cost strategy needs block costs"):
        plan_shards(SD15, "cpu,cpu", "cost", latent_size=8)


def test_explicit_map_forms_contiguous_stages() -> None:
    names = layout_of(SD15).names
    device_map = {name: "cpu" for name in names}
    plan = plan_shards(SD15, strategy="explicit", device_map=device_map)
    assert len(plan.stages) == 1 and plan.blocks == names


def test_boundaries_count_skip_residuals() -> None:
    names = layout_of(SD15).names  # costs whose only balanced split is right after mid_block
    costs = {name: 1.0 if i <= names.index("mid_block") else 1.5 for i, name in enumerate(names)}
    plan = plan_shards(SD15, "cpu,cpu", "cost", block_costs=costs)
    assert plan.stages[0].blocks[-1] == "mid_block"
    (edge,) = plan.boundaries
    assert set(edge.skips) == {str(e) for e in layout_of(SD15).skips}  # every skip crosses
    # the hidden state, the timestep embedding, the text context and all 9 residuals
    assert edge.tensors == 12
    assert edge.bytes > plan.batch * 64 * 4 * 4 * 4  # more than the mid block's output alone


def test_plan_is_printable_and_serialisable() -> None:
    plan = plan_shards(SDXL, "cpu,cpu", "memory", dtype=torch.bfloat16)
    text = str(plan)
    assert "mid_block" in text and "activations" in text
    as_dict = plan.to_dict()
    assert [s["param_bytes"] for s in as_dict["stages"]] == [s.param_bytes for s in plan.stages]
    assert as_dict["dtype"] == "bfloat16"


def test_bfloat16_halves_float32_bytes() -> None:
    fp32 = plan_shards(SD15, "cpu", dtype=torch.float32)
    bf16 = plan_shards(SD15, "cpu", dtype=torch.bfloat16)
    assert bf16.stages[0].param_bytes * 2 == fp32.stages[0].param_bytes


def test_planning_allocates_no_weights() -> None:
    with torch.device("meta"):
        meta = type(SD15).from_config(SD15.config)
    plan = plan_shards(meta, "cpu,cpu", "memory")
    assert all(p.is_meta for p in meta.parameters())
    assert plan.blocks == layout_of(SD15).names


# Errors name the bad value and what to do.


def test_unknown_device() -> None:
    with pytest.raises(DeviceError, match=r"cuda:7.*CUDA device"):
        plan_shards(SD15, "cpu,cuda:7")
    with pytest.raises(DeviceError, match="tpu"):
        plan_shards(SD15, "tpu:0")


def test_budget_too_small_names_device_budget_and_shortfall() -> None:
    with pytest.raises(PlanError, match=r"cpu \(budget 200\.0 KiB.*short"):
        plan_shards(SD15, "cpu", "memory", max_memory="cpu=200KiB")
    with pytest.raises(PlanError, match=r"cpu: .* over its budget of 1\.0 MiB by"):
        plan_shards(SD15, "cpu", "even", max_memory="cpu=1MiB")


def test_explicit_map_missing_a_block() -> None:
    device_map = {name: "cpu" for name in layout_of(SD15).names if name != "mid_block"}
    with pytest.raises(PlanError, match=r"missing blocks \['mid_block'\]"):
        plan_shards(SD15, strategy="explicit", device_map=device_map)


def test_explicit_map_unknown_block() -> None:
    device_map = {name: "cpu" for name in layout_of(SD15).names} | {"down_blocks.9": "cpu"}
    with pytest.raises(PlanError, match=r"unknown blocks \['down_blocks.9'\]"):
        plan_shards(SD15, strategy="explicit", device_map=device_map)


def test_unknown_strategy_and_budget_for_an_unlisted_device() -> None:
    with pytest.raises(PlanError, match="choose one of even, memory, cost, explicit"):
        plan_shards(SD15, "cpu", "fastest")
    with pytest.raises(DeviceError, match="cuda:0"):
        plan_shards(SD15, "cpu", "memory", max_memory="cuda:0=1GiB")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("20GiB", 20 * 2**30), ("1.5GB", 1_500_000_000), ("512 MiB", 512 * 2**20), ("1000", 1000)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="bad size '20 parsecs'"):
        parse_size("20 parsecs")
