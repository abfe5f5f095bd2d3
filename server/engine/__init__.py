"""The ModelShard engine: plan a denoiser's split across devices, then run it split."""

from server.engine.denoisers.blocks import Block, DenoiserSpec, Layout, SkipEdge
from server.engine.denoisers.specs import layout_of, register_spec, spec_for
from server.engine.hardware.memory import DeviceMemory
from server.engine.planning.costs import CostModel, Costs
from server.engine.planning.parallel import Parallel, ParallelPlan, single
from server.engine.planning.plan import ShardPlan, Strategy, plan_shards
from server.engine.planning.planner import plan_parallel
from server.engine.runtime.call import CallPlan, CallResult, RowGroup
from server.engine.runtime.pool import ActivationPool
from server.engine.runtime.replicas import Workers, build_shards, run_micro_batches
from server.engine.runtime.sequence import run_sequence
from server.engine.runtime.shard import ModelShard
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
    "run_sequence",
    "single",
    "spec_for",
]
