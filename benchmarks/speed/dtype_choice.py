"""What `--dtype auto` chooses on this CPU, and whether the denoiser's forward agrees (issue 74).

Per model (the built-in model's UNet, and an SD-1.5-width UNet with random weights, seed 0):

- `choice`: `choose_cpu_dtype` with no cache, as a first start runs it, at the native size and
  `--max-batch`'s default 16 rows (the built-in model; also at 2 rows, where its small ops gain
  less) or 2 rows (the SD-1.5-width UNet, at 64² latents): the gain of the model's heaviest ops
  in bfloat16, the dtype chosen, and the seconds the decision took;
- `forward`: the same UNet's whole eager forward at those rows, float32 and bfloat16 in turn
  (alternating order, a warm-up each), medians over rounds and their ratio, float32 over
  bfloat16: what the choice predicts.

Target (`meets_target`): for every model, the dtype chosen is the one whose forward was faster
(or within 10% of it, where the gain sits near the threshold), and each decision took at most
10 s. On a host without native bfloat16 (`CpuFacts.native_bf16`), float32 with nothing timed.

What a CPU run here cannot show: an AMX host's gain (this project's EPYC has avx512_bf16, no
AMX); a compiled graph's gain (`benchmarks.speed.compile`).

    python -m benchmarks.speed.dtype_choice [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch

from server.demo import MODEL_DIR
from server.engine.hardware.threads import cpu_quota
from server.engine.planning.precision import CpuFacts, choose_cpu_dtype
from server.pipeline.families import meta_denoiser, reference_family
from server.pipeline.loading.folder import read_family

MAX_DECIDE_S = 10.0
CLOSE = 1.10  # a chosen dtype this close to the faster one agrees with it


def forward_seconds(model: torch.nn.Module, rows: int, latent: int, rounds: int) -> dict[str, float]:
    """Median seconds of the eager forward in float32 and bfloat16, in alternating rounds."""
    twins = {"float32": model.float(), "bfloat16": copy.deepcopy(model).to(torch.bfloat16)}
    config = model.config
    inputs = {
        dtype: (
            torch.randn(rows, config.in_channels, latent, latent, dtype=getattr(torch, dtype)),
            torch.full((rows,), 500),
            torch.randn(rows, 77, config.cross_attention_dim, dtype=getattr(torch, dtype)),
        )
        for dtype in twins
    }
    times: dict[str, list[float]] = {dtype: [] for dtype in twins}
    with torch.inference_mode():
        for dtype, twin in twins.items():
            twin(*inputs[dtype][:2], encoder_hidden_states=inputs[dtype][2])  # warm
        for round_ in range(rounds):
            for dtype in list(twins) if round_ % 2 == 0 else list(reversed(twins)):
                sample, timestep, context = inputs[dtype]
                started = time.perf_counter()
                twins[dtype](sample, timestep, encoder_hidden_states=context)
                times[dtype].append(time.perf_counter() - started)
    return {dtype: statistics.median(ts) for dtype, ts in times.items()}


def measure(name: str, rows: int, rounds: int, threads: int) -> dict[str, Any]:
    family = read_family(MODEL_DIR) if name == "built-in" else reference_family(name)
    latent = family.native_size // family.vae_scale_factor
    started = time.perf_counter()
    choice = choose_cpu_dtype(meta_denoiser(family), latent, threads, None, rows)
    decide_s = time.perf_counter() - started
    row: dict[str, Any] = {
        "model": name,
        "rows": rows,
        "latent": latent,
        "chosen": choice.dtype,
        "bf16_gain": None if choice.gain is None else round(choice.gain, 3),
        "decide_s": round(decide_s, 2),
    }
    if choice.gain is None:
        return row | {"agrees": choice.dtype == "float32"}
    torch.manual_seed(0)
    model = family.denoiser_class.from_config(family.config.denoiser).eval()
    seconds = forward_seconds(model, rows, latent, rounds)
    faster = min(seconds, key=seconds.get)
    return row | {
        "forward_s": {dtype: round(s, 4) for dtype, s in seconds.items()},
        "forward_float32_over_bfloat16": round(seconds["float32"] / seconds["bfloat16"], 3),
        "agrees": seconds[choice.dtype] <= CLOSE * seconds[faster],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds, not 5; the built-in model at 16 rows")
    args = parser.parse_args(argv)
    threads = cpu_quota()
    torch.set_num_threads(threads)
    cases = [("built-in", 16), ("sd15", 2)]
    if not args.quick:
        cases.insert(1, ("built-in", 2))
    rounds = 3 if args.quick else 5
    rows = []
    for name, count in cases:
        rows.append(measure(name, count, rounds, threads))
        print(json.dumps(rows[-1]), flush=True)
    summary = {
        "summary": True,
        "cpu": CpuFacts.of_this_host(threads).as_json(),
        "cases": len(rows),
        "max_decide_s": max(r["decide_s"] for r in rows),
        "meets_target": all(r["agrees"] for r in rows) and all(r["decide_s"] <= MAX_DECIDE_S for r in rows),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
