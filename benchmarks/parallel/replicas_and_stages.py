"""Every worker busy at once (issue 14): replicas and pipelined stages vs today's single worker.

Part 1, serving over real HTTP. Three servers (`python -m server serve`, the built-in model at
its default 64x64 and recommended 25 steps and guidance) run side by side:

- `today`:    the default server: one worker (`cpu`) with all the host's intra-op threads;
- `replicas`: `--devices cpu,cpu --parallel replicas`: two CPU workers (`cpu:0`, `cpu:1`) sharing
  the cores, one thread each, each with the whole UNet;
- `pipeline`: `--devices cpu,cpu --parallel pipeline`: the UNet split in two stages, one per
  worker, two micro-batch lanes in flight.

For 1, 2, 4 and 8 concurrent clients, each sending requests ("a red circle", distinct seeds)
back to back (at least 12 images a round, 5 rounds), all three are measured in the same round,
in alternating order. A JSON object per
(clients, server, round): images/s over the round's wall time, p50/p95 latency, and each
worker's busy fraction = (its `/v1/shards` `parallel.busy_seconds` after − before) / wall.

The planner is asked once (`python -m server plan --devices cpu,cpu --parallel auto --json`):
what `--parallel auto` picks and every candidate's predicted rows/s. Predicted rows/s are put
beside measured images/s as **predicted images/s = predicted rows/s / (2 rows per image × 25
steps)** (a guided image is 2 UNet rows a step); the planner predicts at 2 rows per micro-batch,
while the server batches more rows under load, so this is a yardstick, not a forecast.

Part 2, engine. An SD-1.5-architecture UNet (random weights, bf16, CPU) split in 2 stages on
`cpu,cpu` by the `cost` strategy, its blocks timed as a worker runs them (one thread, 2 rows, at
the latent size served), one `ModelShard`; "8 clients" = 16 rows in flight as two micro-batch
lanes of 8 rows at latent 64 (SD-1.5's own 512x512), each lane a thread with one intra-op
thread running forwards back to back through the shared shard, measured over 2 forwards per
lane in the steady state (--quick: 2 rows per lane, 1 forward). At latent 64 whole blocks cut
into two near-equal stages; at latent 32 the best cut of whole blocks is 3:4, so the faster stage
would wait a quarter of the time. Busy fraction per worker = its stage gate's busy seconds over
the window. For comparison (reported, not targeted), the same rows unsplit: one lane of a lane's
rows on one worker with 2 threads, twice as many forwards.

Part 3, GPU, only with two CUDA devices: the same UNet at latent 64, 8 rows per micro-batch: one
GPU (2 sequential forwards a round) vs 2 stages on cuda:0,cuda:1 with 2 lanes vs 2 replicas with
a lane each; rows/s and busy fractions. A GPU stage's "busy" is the host time it held the stage
(kernels run asynchronously), so it bounds device time only loosely. Otherwise one row says it
was skipped.

What a CPU run cannot show: CPU "workers" share one memory, so a stage boundary copies nothing,
whereas real devices move activations over PCIe/NVLink; nor does it show CUDA streams and
asynchronous kernel launches overlapping a stage's compute with the next micro-batch's
transfer. The CPU numbers test the scheduling (gates, lanes, replicas), not the interconnect.

Targets, from the medians over rounds that the summary prints:
- at 2 and at 4 clients, the best of replicas/pipeline (by images/s) serves ≥ 1.3 × today's
  images/s, and its p95 latency is ≤ today's p95;
- at 2 and at 4 clients, the configuration auto picks serves ≥ 0.95 × the images/s of the best
  measured configuration (today included);
- engine: both workers' busy fraction ≥ 0.80 with two pipelined lanes.
`meets_target` is true only when every named check in `checks` holds.

    python -m benchmarks.parallel.replicas_and_stages [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import torch
from torch import nn

from benchmarks.parallel.shard import build_unet
from benchmarks.serving.clients import at_once, client_loop, summary
from server.engine import CostModel, ParallelPlan, build_shards
from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.denoisers.specs import spec_for
from server.engine.hardware.devices import cpu_dtype
from server.engine.hardware.threads import set_intra_op_threads
from server.engine.planning.plan import plan_shards
from server.engine.runtime.shard import ModelShard
from server.pipeline.families.sd import SD
from tests.support.live import LiveServer, live_server

CLIENTS = (1, 2, 4, 8)
TARGET_CLIENTS = (2, 4)
SERVERS: dict[str, tuple[str, ...]] = {
    "today": (),
    "replicas": ("--devices", "cpu,cpu", "--parallel", "replicas"),
    "pipeline": ("--devices", "cpu,cpu", "--parallel", "pipeline"),
}
ROWS_PER_IMAGE = 2  # a guided image: conditional + unconditional row
STEPS_PER_IMAGE = 25  # the built-in model's recommended steps
TARGET_SPEEDUP = 1.3
TARGET_AUTO_SHARE = 0.95
TARGET_BUSY = 0.80
DTYPE = cpu_dtype()  # bfloat16 where the CPU has it natively; float32 where it is emulated (~180× slower)
T = TypeVar("T")


# Part 1: serving over HTTP.


def ask_planner() -> dict[str, Any]:
    """What `--parallel auto` picks on cpu,cpu, and every candidate's prediction."""
    command = [sys.executable, "-m", "server", "plan", "--devices", "cpu,cpu", "--parallel", "auto", "--json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env, timeout=600)
    parallel = json.loads(done.stdout)["parallel"]
    candidates = [
        {
            "config": config_of(c["replicas"], c["stages"], c["note"]),
            "replicas": c["replicas"],
            "stages": c["stages"],
            "predicted_rows_per_s": _round(c["predicted_rows_per_s"]),
            "predicted_images_per_s": _round(predicted_images_per_s(c["predicted_rows_per_s"])),
            "note": c["note"],
        }
        for c in parallel["candidates"]
    ]
    return {
        "planner": True,
        "auto_picks": parallel["kind"],
        "reason": parallel["reason"],
        "candidates": candidates,
    }


def config_of(replicas: int, stages: int, note: str) -> str:
    """The measured server a planner candidate stands for."""
    if (replicas, stages) == (1, 1) and note.startswith("one worker"):
        return "today"
    return {(2, 1): "replicas", (1, 2): "pipeline"}.get((replicas, stages), f"{replicas}x{stages}")


def predicted_images_per_s(rows_per_s: float | None) -> float | None:
    return None if rows_per_s is None else rows_per_s / (ROWS_PER_IMAGE * STEPS_PER_IMAGE)


def busy_seconds(server: LiveServer) -> dict[str, float]:
    return httpx.get(f"{server.url}/v1/shards", timeout=30).json()["parallel"]["busy_seconds"]


def measure(server: LiveServer, clients: int, per_client: int, seed: int) -> dict[str, Any]:
    """`clients` clients at once, `per_client` requests each: throughput, latency, busy fractions."""
    before = busy_seconds(server)
    # client c's requests take seeds (seed + c) * 1000, +1, ...: distinct across clients and rounds
    runs, wall = at_once(clients, lambda c: client_loop(server, per_client, seed + c))
    after = busy_seconds(server)
    busy = {w: round((after[w] - before.get(w, 0.0)) / wall, 3) for w in after}
    return summary(runs, wall) | {"busy_fraction": busy}


def serve_rounds(rounds: int, per_client: Callable[[int], int]) -> list[dict[str, Any]]:
    """Every (clients, server, round) measured and printed; the rows."""
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        servers = {name: stack.enter_context(live_server(*flags)) for name, flags in SERVERS.items()}
        for server in servers.values():
            measure(server, 2, 1, seed=10**6)  # warm-up: both lanes of a two-worker server
        for clients in CLIENTS:
            for round_ in range(rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    seed = (round_ * 100 + clients) * 100  # the same requests for every server
                    row = {"clients": clients, "server": name, "round": round_}
                    row |= measure(servers[name], clients, per_client(clients), seed)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def serving_table(rows: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """Medians over rounds per clients and server; busy fractions per worker."""
    table: dict[int, dict[str, dict[str, Any]]] = {}
    for clients in CLIENTS:
        table[clients] = {}
        for server in SERVERS:
            mine = [r for r in rows if r["clients"] == clients and r["server"] == server]
            cell: dict[str, Any] = {
                key: statistics.median(r[key] for r in mine) for key in ("images_per_s", "p50_s", "p95_s")
            }
            workers = sorted({w for r in mine for w in r["busy_fraction"]})
            cell["busy_fraction"] = {
                w: statistics.median(r["busy_fraction"].get(w, 0.0) for r in mine) for w in workers
            }
            table[clients][server] = cell
    return table


def serving_checks(table: dict[int, dict[str, dict[str, Any]]], auto_picks: str) -> dict[str, Any]:
    """Best of replicas/pipeline over today, and auto's pick against the best, per client count."""
    ratios, checks = {}, {}
    for clients in CLIENTS:
        cells = table[clients]
        today = cells["today"]
        best = max(("replicas", "pipeline"), key=lambda name: cells[name]["images_per_s"])
        overall = max(cells, key=lambda name: cells[name]["images_per_s"])
        ratio = cells[best]["images_per_s"] / today["images_per_s"]
        auto = (
            cells[auto_picks]["images_per_s"] / cells[overall]["images_per_s"] if auto_picks in cells else 0
        )
        ratios[str(clients)] = {
            "best": best,
            "best_over_today_images_per_s": round(ratio, 3),
            "best_p95_s": cells[best]["p95_s"],
            "today_p95_s": today["p95_s"],
            "fastest_measured": overall,
            "auto_pick_over_fastest": round(auto, 3),
        }
        if clients in TARGET_CLIENTS:
            checks[f"speedup_{TARGET_SPEEDUP}x_and_p95_at_{clients}_clients"] = (
                ratio >= TARGET_SPEEDUP and cells[best]["p95_s"] <= today["p95_s"]
            )
            checks[f"auto_within_5pct_at_{clients}_clients"] = auto >= TARGET_AUTO_SHARE
    return {"per_clients": ratios, "checks": checks}


def predicted_vs_measured(
    planner: dict[str, Any], table: dict[int, dict[str, dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    out = {}
    for c in planner["candidates"]:
        measured = {str(n): table[n][c["config"]]["images_per_s"] for n in CLIENTS if c["config"] in table[n]}
        out[c["config"]] = {
            "predicted_rows_per_s": c["predicted_rows_per_s"],
            "predicted_images_per_s (rows/s ÷ (2 rows × 25 steps))": c["predicted_images_per_s"],
            "measured_images_per_s_by_clients": measured,
        }
    return out


# Parts 2 and 3: the engine, without HTTP.


@dataclass(frozen=True)
class LaneRun:
    rows_per_s: float
    wall_s: float
    busy_fraction: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows_per_s": round(self.rows_per_s, 3),
            "wall_s": round(self.wall_s, 3),
            "busy_fraction": {w: round(f, 3) for w, f in self.busy_fraction.items()},
        }


def gate_busy(shards: Sequence[ModelShard]) -> dict[str, float]:
    return {w: s for shard in shards for w, s in shard.gates.stats().busy_s.items()}


def run_lanes(
    shards: Sequence[ModelShard],
    inputs: Sequence[DenoiserInputs],
    forwards: int,
    threads: int | None,
) -> LaneRun:
    """A thread per lane: lane i runs forwards of `inputs[i]` back to back through
    `shards[i % len(shards)]` with `threads` intra-op threads (None: torch's), until told to stop.
    Measured in the steady state, as a server's lanes run: from when every lane has done one
    forward (the pipeline is full) until every lane has done `forwards` more; the lanes go on
    meanwhile, so neither the fill nor the drain of the pipeline falls in the window."""
    done = [0] * len(inputs)
    progress = threading.Condition()
    stop = threading.Event()

    def lane(index: int) -> None:
        if threads is not None:
            set_intra_op_threads(threads)
        shard, x = shards[index % len(shards)], inputs[index]
        while not stop.is_set():
            out = shard(x.sample, x.timestep, x.context, **x.conditioning)
            if out.is_cuda:  # the output device waits for every stage before it
                torch.cuda.synchronize(out.device)
            with progress:
                done[index] += 1
                progress.notify_all()

    def snapshot(at_least: int) -> tuple[float, list[int], dict[str, float]]:
        with progress:
            if not progress.wait_for(lambda: min(done) >= at_least, timeout=1800):
                raise TimeoutError(f"lanes did not reach {at_least} forwards in 30 minutes")
            return time.perf_counter(), list(done), gate_busy(shards)

    with ThreadPoolExecutor(len(inputs), thread_name_prefix="bench-lane") as pool:
        futures = [pool.submit(lane, i) for i in range(len(inputs))]
        try:
            began, first, before = snapshot(1)
            ended, last, after = snapshot(1 + forwards)
        finally:
            stop.set()
        for future in futures:
            future.result()
    wall = ended - began
    rows = sum((b - a) * x.sample.shape[0] for a, b, x in zip(first, last, inputs, strict=True))
    return LaneRun(rows / wall, wall, {w: (after[w] - before[w]) / wall for w in after})


def lane_inputs(
    model: nn.Module, shards: Sequence[ModelShard], lanes: int, rows: int, latent: int
) -> list[DenoiserInputs]:
    """Each lane's inputs, made on the first device of the shard it calls."""
    spec = spec_for(model)
    return [
        spec.example_inputs(model, rows, latent, DTYPE, shards[i % len(shards)].device) for i in range(lanes)
    ]


def timed(
    model: nn.Module,
    shards: Sequence[ModelShard],
    lanes: int,
    rows: int,
    latent: int,
    forwards: int,
    threads: int | None,
) -> LaneRun:
    return run_lanes(shards, lane_inputs(model, shards, lanes, rows, latent), forwards, threads)


def with_threads(threads: int, work: Callable[[], T]) -> T:
    """`work()` with `threads` intra-op threads on this thread: the cost strategy times each block
    as a worker runs it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return work()
    finally:
        torch.set_num_threads(before)


def engine_cpu(model: nn.Module, latent: int, rows: int, forwards: int) -> dict[str, Any]:
    """Two pipelined lanes of `rows` rows through a 2-stage cost split on cpu,cpu, one thread
    each; and the same rows unsplit on one worker with 2 threads."""
    single = plan_shards(model, "cpu", "memory", dtype=DTYPE, latent_size=latent, batch=rows)
    shard = ModelShard(model, single)
    one = timed(model, [shard], 1, rows, latent, 2 * forwards, threads=2)
    # Balance the stages for the work they will do: counted block costs on one thread, as a
    # worker runs them, at the latent size served.
    costs = CostModel(model, 2, latent, DTYPE).costs("cpu", 1)
    split = plan_shards(
        model, "cpu,cpu", "cost", dtype=DTYPE, latent_size=latent, batch=rows, block_costs=costs
    )
    shard = ModelShard(model, split)
    piped = timed(model, [shard], 2, rows, latent, forwards, threads=1)
    stages = [{"blocks": list(s.blocks), "predicted_cost_s": _round(s.cost_s, 4)} for s in split.stages]
    return {
        "engine": "cpu",
        "model": f"sd15 UNet (random weights, seed 0), {str(DTYPE).removeprefix('torch.')}",
        "latent_size": latent,
        "rows_in_flight": 2 * rows,
        "rows_per_lane": rows,
        "forwards_per_lane": forwards,
        "stages": stages,
        "pipeline_2_lanes_1_thread_each": piped.to_dict(),
        "one_worker_2_threads": one.to_dict(),
        "pipeline_over_one_worker_rows_per_s": round(piped.rows_per_s / one.rows_per_s, 3),
    }


def engine_gpu(model: nn.Module, latent: int, rows: int, forwards: int) -> dict[str, Any]:
    """One GPU vs 2 pipelined stages on cuda:0,cuda:1 (2 lanes) vs 2 replicas (a lane each)."""
    if torch.cuda.device_count() < 2:
        return {"gpu": "skipped", "why": "needs two CUDA devices"}

    options = {"dtype": DTYPE, "latent_size": latent, "batch": rows}
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "latent_size": latent}
    shard = ModelShard(model, plan_shards(model, "cuda:0", "memory", **options))
    results["one_gpu"] = timed(model, [shard], 1, rows, latent, 2 * forwards, None).to_dict()
    split = plan_shards(model, "cuda:0,cuda:1", "cost", **{**options, "batch": 2 * rows})
    shard = ModelShard(model, split)
    results["pipeline_2_stages_2_lanes"] = timed(model, [shard], 2, rows, latent, forwards, None).to_dict()
    plans = tuple(plan_shards(model, device, "memory", **options) for device in ("cuda:0", "cuda:1"))
    shards = build_shards(model, ParallelPlan(plans, 1, workers=("cuda:0", "cuda:1")))
    results["replicas_2"] = timed(model, shards, 2, rows, latent, forwards, None).to_dict()
    base = results["one_gpu"]["rows_per_s"]
    results |= {
        "rows_per_lane": rows,
        "forwards_per_lane": forwards,
        "over_one_gpu_rows_per_s": {
            name: round(results[name]["rows_per_s"] / base, 3)
            for name in ("pipeline_2_stages_2_lanes", "replicas_2")
        },
        "note": "GPU busy = host time a stage was held; kernels run asynchronously",
    }
    return results


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 round of 1 request per client; engine: 2 rows per lane, 1 forward per lane",
    )
    args = parser.parse_args(argv)
    if args.quick:
        rounds, per_client = 1, (lambda clients: 1)
        cpu_latent, cpu_rows, cpu_forwards, gpu_forwards = 64, 2, 1, 3
    else:
        # rounds of at least 12 images: shorter ones swing ±25% on this shared 2-core machine
        rounds, per_client = 5, (lambda clients: max(3, 12 // clients))
        cpu_latent, cpu_rows, cpu_forwards, gpu_forwards = 64, 8, 2, 20

    # Part 1: the planner first (it profiles; nothing else should be running), then the servers.
    planner = ask_planner()
    print(json.dumps(planner), flush=True)
    rows = serve_rounds(rounds, per_client)
    table = serving_table(rows)
    serving = serving_checks(table, planner["auto_picks"])

    # Parts 2 and 3: one SD-1.5 UNet, shared.
    model = build_unet(SD.reference_configs["sd15"], DTYPE)
    engine = engine_cpu(model, cpu_latent, cpu_rows, cpu_forwards)
    print(json.dumps(engine), flush=True)
    gpu = engine_gpu(model, 64, 8, gpu_forwards)
    print(json.dumps(gpu), flush=True)

    busy = engine["pipeline_2_lanes_1_thread_each"]["busy_fraction"]
    checks = {
        **serving["checks"],
        f"engine_busy_at_least_{TARGET_BUSY}_on_both_workers": len(busy) == 2
        and min(busy.values()) >= TARGET_BUSY,
    }
    summary = {
        "summary": True,
        "rounds": rounds,
        "requests_per_client": {str(c): per_client(c) for c in CLIENTS},
        "table": {str(c): cells for c, cells in table.items()},
        "best_over_today": serving["per_clients"],
        "auto_picks": planner["auto_picks"],
        "planner_reason": planner["reason"],
        "predicted_vs_measured": predicted_vs_measured(planner, table),
        "busy_fraction_median": {
            str(c): {server: cell["busy_fraction"] for server, cell in cells.items()}
            for c, cells in table.items()
        },
        "engine": {
            "busy_fraction": busy,
            "pipeline_rows_per_s": engine["pipeline_2_lanes_1_thread_each"]["rows_per_s"],
            "one_worker_rows_per_s": engine["one_worker_2_threads"]["rows_per_s"],
            "pipeline_over_one_worker_rows_per_s": engine["pipeline_over_one_worker_rows_per_s"],
        },
        "gpu": gpu.get("over_one_gpu_rows_per_s", gpu.get("gpu")),
        "targets": {
            "best_over_today_at_2_and_4": TARGET_SPEEDUP,
            "best_p95_at_most_today_p95_at_2_and_4": True,
            "auto_pick_over_fastest_at_2_and_4": TARGET_AUTO_SHARE,
            "engine_busy_fraction_each_worker": TARGET_BUSY,
        },
        "checks": checks,
        "meets_target": all(checks.values()),
        "config": {"threads": torch.get_num_threads(), "torch": torch.__version__, "quick": args.quick},
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
