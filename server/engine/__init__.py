"""The ModelShard engine: plan a denoiser's split across devices, then run it split."""

from server.engine.blocks import Block, DenoiserSpec, Layout, SkipEdge
from server.engine.call import CallPlan, CallResult, RowGroup
from server.engine.costs import CostModel, Costs
from server.engine.memory import DeviceMemory
from server.engine.parallel import Parallel, ParallelPlan, single
from server.engine.plan import ShardPlan, Strategy, plan_shards
from server.engine.planner import plan_parallel
from server.engine.pool import ActivationPool
from server.engine.replicas import Workers, build_shards, run_micro_batches
from server.engine.shard import ModelShard
from server.engine.specs import layout_of, register_spec, spec_for
from server.errors import DeviceError, PlanError

__all__ = [
    "ActivationPool",
    "Block",
    "CallPlan",
    "CallResult",
    "CostModel",
    "Costs",
    "DenoiserSpec",
    "DeviceError",
    "DeviceMemory",
    "Layout",
    "ModelShard",
    "Parallel",
    "ParallelPlan",
    "PlanError",
    "RowGroup",
    "ShardPlan",
    "SkipEdge",
    "Strategy",
    "Workers",
    "build_shards",
    "layout_of",
    "plan_parallel",
    "plan_shards",
    "register_spec",
    "run_micro_batches",
    "single",
    "spec_for",
]
