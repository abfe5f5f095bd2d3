"""Record what `tests/support/bf16_rounds.json` holds, on this host: rounds of (float32, bfloat16)
seconds of an SD-1.5-width UNet's heaviest ops (`precision.py`'s choice of them) at 2 rows of 32²
latents on 2 threads, 12 rounds an op with no early stop; first beside a busy neighbour (a
process running 2-thread float32 matmuls in bursts, 40 ms on and 40 ms off), then alone.

    python -m tests.support.record_bf16_rounds FILE
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from server.engine.planning.precision import MOST_OPS, CpuFacts, _rounds, record_ops
from server.pipeline.families import meta_denoiser, reference_family

ROUNDS, THREADS = 12, 2
NEIGHBOUR = """
import time, torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
while True:
    until = time.perf_counter() + 0.04
    while time.perf_counter() < until:
        a @ a
    time.sleep(0.04)
"""


def main(out: Path) -> None:
    ops = record_ops(meta_denoiser(reference_family("sd15")), 2, 32)
    total = sum(op.flops * n for op, n in ops.items())
    heaviest = sorted(ops.items(), key=lambda item: -item[0].flops * item[1])[:MOST_OPS]
    recorded: dict[str, Any] = {
        "cpu": CpuFacts.of_this_host(THREADS).as_json(),
        "model": "sd15 UNet (reference config), 2 rows of 32² latents",
        "neighbour": "a process running 2-thread float32 1024² matmuls, 40 ms on / 40 ms off",
        "ops": [{"op": op.describe(), "count": n, "share": op.flops * n / total} for op, n in heaviest],
    }
    torch.set_num_threads(THREADS)
    for key in ("busy_rounds", "quiet_rounds"):
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if key == "busy_rounds" else None
        try:
            if neighbour is not None:
                time.sleep(2.0)  # its interpreter and torch up: bursts from here on
            with torch.inference_mode():
                for entry, (op, _) in zip(recorded["ops"], heaviest, strict=True):
                    rounds = itertools.islice(_rounds(op), ROUNDS)
                    entry[key] = [[round(full, 7), round(half, 7)] for full, half in rounds]
        finally:
            if neighbour is not None:
                neighbour.kill()
    out.write_text(json.dumps(recorded, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
