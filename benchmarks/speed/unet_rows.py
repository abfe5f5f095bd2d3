"""How the built-in UNet's forward time grows with rows: the bound on step-level batching.

8 guided requests are 16 rows; one is 2. If 16 rows cost k times 2 rows, stepping 8 requests
together can serve at most 8 / k times the images of one request at a time. Rows 2, 4, 8 and
16 are timed in interleaved rounds (2 CPU threads, float32, the native 16x16 latent).

    python -m benchmarks.speed.unet_rows [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from server.engine.hardware.memory import retain_freed_host_memory
from server.pipeline.pipeline import Pipeline

ROWS = (2, 4, 8, 16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 rounds instead of 15")
    args = parser.parse_args(argv)
    retain_freed_host_memory()
    pipeline = Pipeline.load(devices="cpu")
    unet, size = pipeline.components.denoiser, pipeline.components.denoiser.config.sample_size
    generator = torch.Generator().manual_seed(0)
    dim = unet.config.cross_attention_dim
    inputs = {
        rows: (
            torch.randn(rows, unet.config.in_channels, size, size, generator=generator),
            torch.full((rows,), 500.0),
            torch.randn(rows, 77, dim, generator=generator),
        )
        for rows in ROWS
    }
    times: dict[int, list[float]] = {rows: [] for rows in ROWS}
    with torch.inference_mode():
        for rows in ROWS:  # warm-up
            unet(*inputs[rows][:2], encoder_hidden_states=inputs[rows][2])
        for round_ in range(4 if args.quick else 15):
            for rows in ROWS:
                sample, timesteps, context = inputs[rows]
                start = time.perf_counter()
                unet(sample, timesteps, encoder_hidden_states=context)
                times[rows].append(time.perf_counter() - start)
            print(
                json.dumps({"round": round_, **{f"rows_{r}_ms": round(times[r][-1] * 1e3, 2) for r in ROWS}})
            )
    median = {rows: statistics.median(values) for rows, values in times.items()}
    cost_16 = median[16] / median[2]
    print(
        json.dumps(
            {
                "summary": True,
                **{f"rows_{r}_median_ms": round(median[r] * 1e3, 2) for r in ROWS},
                "cost_16_over_2": round(cost_16, 3),
                "batching_ceiling_at_8_requests": round(8 / cost_16, 3),
                "threads": torch.get_num_threads(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
