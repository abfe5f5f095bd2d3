"""The ModelShard engine: plan a denoiser's split across devices, then run it split."""

from server.engine.blocks import Block, DenoiserSpec, Layout, SkipEdge, layout_of, register_spec
from server.engine.devices import DeviceError
from server.engine.memory import DeviceMemory
from server.engine.plan import PlanError, ShardPlan, plan_shards
from server.engine.shard import ModelShard

__all__ = [
    "Block",
    "DenoiserSpec",
    "DeviceError",
    "DeviceMemory",
    "Layout",
    "ModelShard",
    "PlanError",
    "ShardPlan",
    "SkipEdge",
    "layout_of",
    "plan_shards",
    "register_spec",
]
