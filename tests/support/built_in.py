"""The built-in model as `make run` serves it (its LoRA adapter and ControlNet), and a batch with a
row of every kind the step loop mixes: shared by the tests that step such a batch on simulated
GPUs and on a lent one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PIL import Image

from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.requests import Edit, GenerationRequest
from server.requests.control import Control
from server.requests.step_cache import StepCache

DEMO = Path(__file__).resolve().parents[2] / "server" / "demo"


def with_make_run_parts(pipeline: Pipeline) -> Pipeline:
    """`pipeline` (of the built-in model) with `make run`'s adapter and ControlNet."""
    pipeline.add_adapter(read_adapter("diamond", DEMO / "adapters" / "diamond.safetensors", pipeline.family))
    pipeline.controlnets.load("silhouette", DEMO / "controlnets" / "silhouette")
    return pipeline


def rows_of_every_kind() -> list[GenerationRequest]:
    """A plain row, a LoRA row, a ControlNet row, a step-cached row and an edit, stepped together."""
    circle = Image.new("RGB", (64, 64), (0, 0, 0))
    circle.paste((255, 255, 255), (16, 16, 48, 48))
    plain = GenerationRequest("a red circle", seed=3, steps=4)
    return [
        plain,
        replace(plain, seed=4, lora=(("diamond", 1.0),)),
        replace(plain, seed=5, control=(Control("silhouette", circle, 1.0),)),
        replace(plain, seed=6, step_cache=StepCache("deep", interval=2)),
        replace(plain, seed=7, edit=Edit(circle, strength=0.6)),
    ]
