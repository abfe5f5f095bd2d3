"""Qwen-Image 2.1's prefix KV cache (issue 72): a step on a request's kept prefix keys and values
against the same step recomputing the prefix (what every step costs with the cache off), through
the engine's spec (`server/engine/denoisers/qwenimage21.py`) on one device.

A `QwenImage21Transformer2DModel` with random weights (seed 0), float32, at a width the CPU can
time (8 heads × 128 = 1024, 4 blocks; the real one is 32 × 128 and 32 blocks: the same per-token
work a block, fewer blocks and a narrower MLP), 512×512 output (32×32 = 1024 target tokens):

- `text`: a 256-token prompt (text to image);
- `edit`: the prompt and one 512² condition image (1024 latent tokens in 256 vision slots).

Per round, in alternating order: the cached step and the recomputing step, each timed alone (one
row). Reported: medians over rounds, the ratio recomputing/cached (`meets_target`: ≥ 1.1 for
`text`, ≥ 1.5 for `edit`, where the prefix outweighs the target), and the largest difference
between the two predictions (float32: the same numbers up to rounding).

What a CPU run cannot show: the GPU's share of the saving (attention over the prefix there is
cheap beside the projections the cache skips, as here, but kernels differ).

    python -m benchmarks.speed.prefix_cache [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from diffusers import QwenImage21Transformer2DModel

from server.engine.denoisers.blocks import (
    IMAGE_SLOTS,
    REFERENCE_SHAPES,
    REFERENCES,
    TEXT_MASK,
    DenoiserInputs,
    Flow,
)
from server.engine.denoisers.qwenimage21 import HELD, QwenImage21TransformerSpec

TARGETS = {"text": 1.1, "edit": 1.5}
PROMPT = 256  # Qwen3-VL tokens of the prompt
CONDITION = 32  # a condition image's side in latent tokens (512 px)


def build(quick: bool) -> QwenImage21Transformer2DModel:
    torch.manual_seed(0)
    heads = 4 if quick else 8
    return QwenImage21Transformer2DModel(
        num_layers=2 if quick else 4,
        num_attention_heads=heads,
        attention_head_dim=128,
        in_channels=64,
        out_channels=64,
        context_in_dim=heads * 128,
        axes_dims_rope=(16, 56, 56),
    ).eval()


def first_inputs(model: QwenImage21Transformer2DModel, side: int, edit: bool) -> DenoiserInputs:
    """A request's first call: the prompt (and its image's slots, then its latent tokens)."""
    config = model.config
    slots = (CONDITION // 2) ** 2 if edit else 0
    tokens = PROMPT + slots
    context = torch.randn(1, tokens, config.context_in_dim)
    conditioning: dict[str, Any] = {TEXT_MASK: torch.ones(1, tokens)}
    if edit:
        marks = torch.zeros(1, tokens)
        marks[0, 8 : 8 + slots] = 1  # after the template's first tokens, as the processor puts them
        conditioning |= {
            IMAGE_SLOTS: marks,
            REFERENCES: torch.randn(1, CONDITION * CONDITION, config.in_channels),
            REFERENCE_SHAPES: torch.tensor([[[CONDITION, CONDITION]]]).float(),
        }
    sample = torch.randn(1, config.in_channels, side, side)
    return DenoiserInputs(sample, torch.tensor([700.0]), context, conditioning)


def walk(spec: QwenImage21TransformerSpec, model: Any, inputs: DenoiserInputs) -> tuple[torch.Tensor, dict]:
    """The spec's blocks in order on one device (as `walk_plain`), and what the rows keep."""
    flow = spec.begin(model, inputs)
    for call in spec.calls(model).values():
        flow = Flow(call.fn(call.owner, flow.rows, flow.shared), flow.shared)
    return spec.end(model, flow, inputs), spec.held(model, flow)


def timed(spec: QwenImage21TransformerSpec, model: Any, inputs: DenoiserInputs) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    out, _ = walk(spec, model, inputs)
    return time.perf_counter() - started, out


@torch.inference_mode()
def measure(case: str, model: Any, side: int, rounds: int) -> dict[str, Any]:
    spec = QwenImage21TransformerSpec()
    first = first_inputs(model, side, edit=case == "edit")
    _, held = walk(spec, model, first)
    later = DenoiserInputs(first.sample, first.timestep, first.context, {**first.conditioning, **held})
    ways = {"cached": later, "recomputed": first}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    outs: dict[str, torch.Tensor] = {}
    for inputs in ways.values():  # a warm-up each
        timed(spec, model, inputs)
    for round_ in range(rounds):
        for way in list(ways)[round_ % 2 :] + list(ways)[: round_ % 2]:
            took, outs[way] = timed(spec, model, ways[way])
            seconds[way].append(took)
            print(json.dumps({"case": case, "round": round_, "way": way, "seconds": round(took, 4)}))
    cached, recomputed = (statistics.median(seconds[w]) for w in ways)
    prefix = held[next(iter(HELD))].shape[3]
    return {
        "case": case,
        "prefix_tokens": int(prefix),
        "target_tokens": side * side,
        "cached_s": round(cached, 4),
        "recomputed_s": round(recomputed, 4),
        "speedup": round(recomputed / cached, 3),
        "max_difference": float((outs["cached"] - outs["recomputed"]).abs().max()),
        "target": TARGETS[case],
        "meets_target": recomputed / cached >= TARGETS[case],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a narrower model, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    model, side = build(args.quick), 32
    results = [measure(case, model, side, rounds) for case in TARGETS]
    for result in results:
        print(json.dumps(result))
    summary = {"summary": "prefix_cache", "rounds": rounds, "cases": results}
    summary["meets_target"] = all(r["meets_target"] for r in results)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
