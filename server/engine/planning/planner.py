"""`plan_parallel`: which replicas × stages, lanes and threads to run over the devices given.

Every candidate is predicted from seconds per block (`costs.py`: counted by default, measured
when asked), never by running it:

- throughput under load (rows/s) = replicas × a lane's rows / the slowest stage (its incoming
  boundary copy included), each lane batching its share of `batch` rows as `Service` gives it;
- a lone guided image's step: its 2 rows through every stage of one replica in turn, or split
  over the idle replicas (a row each, at once) where that is predicted quicker.

The fastest wins; within NEAR of it, the one quicker for a lone image. Today's single worker is
a candidate like the others: one GPU (or the layer split) when replicas do not fit or do not
pay, one CPU worker when a model gains nothing from more workers. The CPU alone (`cpu`) may
run several lanes (2, 4, … up to the quota), sharing its cores and one copy of the weights.

CPU workers share the host's cores: the workers' threads in all never exceed the CPU quota
(`threads`; more busy workers than cores are predicted, never picked by auto), and when they
fill it, the server's own threads (event loop, the step loops' Python, image encoding) take
cores from them: predicted times are stretched by (the workers' threads + HTTP_CORES) / quota,
and their per-op overhead is the one timed beside such a thread (`calibrate.shared_overhead`).
That is why, on 2 cores, a dispatch-bound model runs one thread a lane and an SD-sized one
gains from two.

Subsets of the devices are weighed too: for every stage count, as many replicas as the devices
hold (more replicas of the same stages only add throughput), so 5 GPUs weigh 2 replicas × 2
stages on 4 of them, and `cpu,cpu,cpu` on 2 cores two workers. Auto never leaves CPU cores
idle: a worker running fewer threads than its share of the quota (a lone worker with fewer
threads than cores) is chosen only when nothing that fills the quota fits (on a busy host the
calibration is too noisy to trust an idle core's predicted gain).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from server.engine.denoisers.specs import native_latent
from server.engine.hardware.devices import parse_memory_map, resolve_devices, worker_names
from server.engine.planning.choose import choose
from server.engine.planning.costs import CostModel
from server.engine.planning.parallel import (
    PARALLEL_MODES,
    Candidate,
    Parallel,
    ParallelPlan,
    shared_budgets,
    single,
    weighed_shapes,
)
from server.engine.planning.plan import ShardPlan, Strategy, plan_shards
from server.engine.planning.sequence import Link, split_blocks
from server.engine.planning.tensor import TensorAxis
from server.errors import PlanError

# Bytes per second a stage boundary moves between two GPUs: PCIe 4.0 x16 in practice. An
# estimate (NVLink is faster); on one host's CPU workers a boundary moves nothing.
BOUNDARY_BYTES_PER_S = 16e9
# Cores the server's own threads keep busy beside the workers under load (event loop, step
# loops between forwards, PNG encoding): an estimate, checked by benchmarks.parallel.thread_default.
HTTP_CORES = 0.5

# (device, threads, rows=, workers=, beside_server=) → seconds per block for `rows` rows on one
# of `workers` busy workers (CPU workers share the cores and the interpreter; `beside_server`:
# they fill the quota, beside the server's own threads)
BlockCosts = Callable[..., Mapping[str, float]]


def plan_parallel(
    model: nn.Module,
    devices: str | Sequence[str],
    parallel: str = Parallel.AUTO,
    strategy: str = Strategy.MEMORY,
    *,
    threads: int = 1,
    rows: int = 2,
    block_costs: BlockCosts | None = None,
    costs_note: str = "",
    pick_threads: bool = True,
    timed: bool = False,
    lone_rows: int = 2,
    links: Callable[[str, int], Link] | None = None,
    layout: str | None = None,
    spread: int = 0,
    **plan_options: Any,
) -> ParallelPlan:
    """Replicas × stages over `devices` (see the module's docstring).

    `threads` is the CPU's intra-op threads in all (CPU workers share them). Throughput is
    predicted under load, each lane batching its share of `batch` rows (what `Service` gives
    it), a lone image's step at 2 rows (split over idle replicas where that is predicted
    quicker), from `block_costs` (seconds per block; default: counted at `rows` rows,
    `CostModel`). A lone CPU worker runs the thread count predicted fastest, or all `threads`
    without `pick_threads`. `timed`: `block_costs` time the whole model on a device, so a model
    that fits no single device cannot be costed. A lone image is `lone_rows` rows (2: guided);
    a sequence group's ranks exchange over `links(device, threads)` (`sequence.py`). `spread`:
    the bytes of `resident` (text encoders) a tensor group's ranks share on separate GPUs.
    `plan_options` go to `plan_shards` (dtype, latent_size, batch, max_memory, resident, device_map).
    """
    if parallel not in PARALLEL_MODES:
        raise PlanError(f"unknown parallel mode {parallel!r}: choose one of {', '.join(PARALLEL_MODES)}")
    device_list = resolve_devices(devices)
    budgets = parse_memory_map(plan_options.get("max_memory"))
    for device in budgets:  # subsets get their own devices' budgets: check the whole map once
        if device not in device_list:
            raise PlanError(f"max_memory names {device}, which is not among the devices {device_list}")
    latent = native_latent(model)  # given costs are counted at the native size, as `plan_model`'s
    if block_costs is None:
        latent = plan_options.get("latent_size") or latent
        dtype = plan_options.get("dtype") or next(model.parameters()).dtype
        block_costs = CostModel(model, rows, latent, dtype).costs
        costs_note = costs_note or "counted"
    search = _Search(
        model, device_list, strategy, threads, block_costs, plan_options | {"max_memory": budgets}
    )
    search.pick_threads, search.latent, search.lone_rows = pick_threads, latent, lone_rows
    search.spread = spread
    search.grouped = parallel == Parallel.SEQUENCE
    search.links = links or (lambda device, threads: Link(BOUNDARY_BYTES_PER_S))
    if parallel == Parallel.SEQUENCE and len(device_list) < 2:
        raise PlanError(
            "--parallel sequence splits tokens over two or more devices: --devices cpu,cpu or cuda:0,cuda:1"
        )
    if layout is not None:
        return search.layout(layout, costs_note)
    if parallel == Parallel.TENSOR:
        return search.tensor_group(costs_note)
    if parallel == Parallel.SEQUENCE and not search.split:
        raise PlanError(
            f"--parallel sequence splits a DiT's tokens; {type(model).__name__} has no blocks to "
            "split (a UNet's convolutions mix neighbouring pixels): use replicas or pipeline"
        )

    # 1. One worker: a single device, or the layer split when the model needs every device. The
    # CPU alone may run several workers (lanes sharing its cores and one copy of the weights),
    # unless --threads fixed a lone worker's threads.
    cpu_lanes = device_list == ["cpu"] and parallel == Parallel.AUTO and pick_threads and search.quota > 1
    if parallel == Parallel.OFF or (len(device_list) == 1 and not cpu_lanes):
        return search.one_worker(parallel, costs_note)
    whole = search.fits_one()
    if not whole and parallel == Parallel.REPLICAS:
        raise PlanError(f"replicas need the whole model on each device, and it does not fit {device_list[0]}")
    if not whole and timed:  # its blocks cannot be timed on one device: a lane per stage of the split
        return search.pipeline_only(costs_note)

    # 2. Every shape of replicas × stages (over subsets of the devices), and one worker beside them.
    if cpu_lanes:  # 2, 4, … and quota workers of one CPU, each a share of its threads
        shapes = [
            (w, 1) for w in sorted({2**k for k in range(1, search.quota.bit_length())} | {search.quota})
        ]
    else:
        shapes = weighed_shapes(
            len(device_list), Parallel(parallel), search.quota if search.all_cpu else None
        )
    for replicas, stages in shapes:
        if stages == 1 and not whole:
            search.add(Candidate(replicas, 1, None, "the whole model does not fit one device"))
        else:
            search.add_shape(replicas, stages)
    if parallel == Parallel.AUTO and not search.all_cpu:
        search.add_tensor_shapes()
    baselines = search.add_baselines()

    # 3. The fastest that fits (auto may pick a baseline; replicas and pipeline were asked for).
    best, reason = choose(search, baselines, Parallel(parallel), whole, device_list, costs_note)
    return search.plan_of(best, reason, costs_note)


class _Search(TensorAxis):
    """The candidates weighed so far, and the plans behind them (tensor groups': `TensorAxis`)."""

    def __init__(self, model, devices, strategy, threads, block_costs, options) -> None:
        self.model, self.devices, self.strategy, self.options = model, devices, strategy, options
        self.quota, self.batch = max(1, threads), int(options.get("batch", 2))
        self.block_costs = block_costs
        self.all_cpu = all(d == "cpu" for d in devices)
        self.turns = max(
            Counter(d for d in devices if d != "cpu").values(), default=1
        )  # a GPU listed k times
        self.candidates: list[Candidate] = []
        self.crowded: set[int] = set()  # candidates with more busy CPU workers than cores
        self.pick_threads = True
        self.latent = 0  # the latent side the block costs were counted at
        self.singles: dict[tuple[str, ...], ShardPlan] = {}  # devices → the one-worker plan
        self.plans: dict[int, tuple[tuple[ShardPlan, ...], int]] = {}  # id(candidate) → plans, lanes
        self.dtype = options.get("dtype") or next(model.parameters()).dtype
        self.split = split_blocks(model)  # what a sequence group splits (none: no group)
        self.grouped = False  # --parallel sequence: every call a group over every replica
        self.lone_rows = 2
        self.links: Callable[[str, int], Link] = lambda device, threads: Link(BOUNDARY_BYTES_PER_S)

    # Shapes.

    def add_shape(self, replicas: int, stages: int) -> Candidate:
        workers = replicas * stages
        # lanes of one CPU, or the first `workers` devices given
        devices = self.devices * replicas if self.devices == ["cpu"] else self.devices[:workers]
        groups = [devices[i * stages : (i + 1) * stages] for i in range(replicas)]
        threads = max(1, self.quota // workers) if self.all_cpu else 1
        rows = self.batch if self.grouped else self._lane_rows(stages)
        costs = self.block_costs(groups[0][0], threads, rows=rows, **self._sharing(workers, threads))
        try:
            split = tuple(self._split(groups, i, costs, stages) for i in range(replicas))
        except PlanError as err:
            return self.add(Candidate(replicas, stages, None, str(err), grouped=self.grouped))
        step_s = self._slowest_stage_s(split[0], costs, rows) * self._stretch(workers, threads)
        if self.grouped:  # one lane, every call a group over every replica
            step_s = self._group_s(split[0], threads, rows, replicas)
        lone_s, splits, degree = self._lone_step(split[0], replicas, threads)
        crowded = self.all_cpu and workers > self.quota  # run only when asked for by name
        cpu_threads = threads if self.all_cpu else None
        note = self._note(workers, cpu_threads, len(devices))
        rate = (1 if self.grouped else replicas) * rows / step_s
        candidate = Candidate(replicas, stages, rate, note, lone_s, cpu_threads, splits, degree, self.grouped)
        if crowded:
            self.crowded.add(id(candidate))
        self.plans[id(candidate)] = (split, stages)  # a lane per stage keeps every stage busy
        return self.add(candidate)

    def add_baselines(self) -> list[Candidate]:
        """Today's one worker: on CPU, one lane with the threads that serve it fastest (what
        `--devices cpu` runs), and one with every thread if that is not the same; on GPUs, one
        device where the model fits one, else the layer split with one lane (every stage in turn)."""
        one = not self.all_cpu and self.fits_one()
        try:
            plan = self._single(["cpu"] if self.all_cpu else self.devices[:1] if one else self.devices)
        except PlanError:
            return []
        if not self.all_cpu:
            return [self._baseline(plan, 1, "one device" if one else "one lane through the layer split")]
        best = self.best_threads()
        return [
            self._baseline(plan, t, f"one worker, {t} thread{'s' * (t != 1)}")
            for t in dict.fromkeys((best, self.quota))
        ]

    def _baseline(self, plan: ShardPlan, threads: int, note: str) -> Candidate:
        seconds = self._step_s(plan, threads, self.batch, workers=1)
        lone_s, _, _ = self._lone_step(plan, 1, threads)
        cpu_threads = threads if self.all_cpu else None
        note = ", ".join(filter(None, (note, self._note(1, cpu_threads, len(plan.devices)))))
        candidate = Candidate(1, len(plan.stages), self.batch / seconds, note, lone_s, cpu_threads)
        self.plans[id(candidate)] = ((plan,), 1)
        return self.add(candidate)

    def _note(self, workers: int, threads: int | None, devices: int) -> str:
        """What a candidate leaves unused or oversubscribes, said beside its figures."""
        if threads is not None and workers > self.quota:
            return f"{workers} busy workers on {self.quota} cores"
        notes = []
        if threads is not None and workers * threads < self.quota:
            notes.append(f"{self.quota - workers * threads} of {self.quota} cores idle")
        if not self.all_cpu and devices < len(self.devices):  # CPU workers say it by their count
            notes.append(f"{devices} of the {len(self.devices)} devices")
        return ", ".join(notes)

    def best_threads(self) -> int:
        """A lone CPU worker's threads: the count predicted fastest among 1, powers of two, the
        quota less one and the quota (each count is a calibration, cached); the quota itself
        when the user set it (`--threads` overrides)."""
        if not self.pick_threads:
            return self.quota

        def seconds(threads: int) -> float:
            return self._step_s(self._single(["cpu"]), threads, self.batch, workers=1)

        counts = {1, self.quota - 1, self.quota} | {2**k for k in range(1, self.quota.bit_length())}
        return min((t for t in counts if 1 <= t <= self.quota), key=lambda t: (seconds(t), t))

    # Plans.

    def one_worker(self, parallel: str, costs_note: str) -> ParallelPlan:
        plan = self._single(self.devices)
        if not self.all_cpu:
            return single(plan, costs=costs_note)
        threads = self.best_threads() if len(self.devices) == 1 else self.quota
        reason = f"{threads} of {self.quota} thread(s) predicted fastest for one worker"
        if not self.pick_threads:
            reason = f"--threads {threads}: one worker runs them all"
        if parallel == Parallel.OFF and len(self.devices) > 1:
            reason = "--parallel off: one lane through the layer split"
        return single(plan, threads, reason=reason, costs=costs_note)

    def pipeline_only(self, costs_note: str) -> ParallelPlan:
        plan = plan_shards(self.model, self.devices, self.strategy, **self.options)
        reason = (
            "the model does not fit one device, so no replicas, and measured costs time it whole on one: "
            f"{len(self.devices)} pipelined stages split by {self.strategy}, a lane per stage"
        )
        threads = max(1, self.quota // len(self.devices)) if self.all_cpu else None
        candidate = Candidate(1, len(self.devices), None, "not costed: --costs counted predicts it")
        workers = tuple(worker_names(self.devices))
        return ParallelPlan((plan,), len(plan.stages), threads, (candidate,), reason, workers, costs_note)

    def plan_of(self, best: Candidate, reason: str, costs_note: str) -> ParallelPlan:
        split, lanes = self.plans[id(best)]
        workers = tuple(worker_names([s.device for plan in split for s in plan.stages]))
        return ParallelPlan(
            split,
            1 if best.grouped else lanes,
            best.threads,
            tuple(self.candidates),
            reason,
            workers,
            costs_note,
            best.splits_lone,
            best.sequence,
            best.grouped,
            tensor=best.tensor,
        )

    # Helpers.

    def fits_one(self) -> bool:
        try:
            self._single(self.devices[:1])
        except PlanError:
            return False
        return True

    def add(self, candidate: Candidate) -> Candidate:
        self.candidates.append(candidate)
        return candidate

    def _single(self, devices: Sequence[str]) -> ShardPlan:
        """The one-worker plan over `devices`, made once (each thread count weighed asks for it)."""
        key = tuple(devices)
        if key not in self.singles:
            costs = {}
            if self.strategy == Strategy.COST:  # balance the layer split by its blocks' seconds
                threads = max(1, self.quota // len(devices))
                costs["block_costs"] = lambda device: self.block_costs(device, threads)
            options = self._options(devices)
            self.singles[key] = plan_shards(self.model, list(devices), self.strategy, **costs, **options)
        return self.singles[key]

    def _split(self, groups: list[list[str]], i: int, costs: Mapping[str, float], stages: int) -> ShardPlan:
        """Replica `i`'s plan over its group: a pipeline balances its blocks' seconds (its slowest
        stage sets the pace), a single stage just has to fit. The encoders and VAE sit with the
        first replica's first stage only (`Pipeline.load`); replicas on one GPU share its budget."""
        group, resident = groups[i], self.options.get("resident", 0)
        budgets = shared_budgets(groups, self.options["max_memory"], resident)[i]
        options = self.options | {"max_memory": budgets, "resident": resident if i == 0 else 0}
        if stages > 1:
            return plan_shards(self.model, group, Strategy.COST, block_costs=costs, **options)
        return plan_shards(self.model, group, self.strategy, **options)

    def _options(self, devices: Sequence[str]) -> dict[str, Any]:
        """`plan_shards`' options for a subset of the devices: only their own budgets (a budget
        naming another device is refused there, which made every subset "not fit")."""
        budgets = {d: b for d, b in self.options["max_memory"].items() if d in devices}
        return self.options | {"max_memory": budgets}

    def _stretch(self, workers: int, threads: int) -> float:
        """How much slower workers run together: CPU ones asking, with the server's threads, for more
        cores than the quota (sharing cores and memory bandwidth); a GPU's k workers take turns."""
        if not self.all_cpu:
            return float(min(workers, self.turns))
        busy = workers * threads
        return max(1.0, (busy + HTTP_CORES) / self.quota) if busy >= self.quota else 1.0

    def _slowest_stage_s(self, plan: ShardPlan, costs: Mapping[str, float], rows: int) -> float:
        """Seconds of the slowest stage for one micro-batch, its incoming boundary copy included."""
        return max(self._stage_seconds(plan, costs, rows))

    def _lane_rows(self, lanes: int) -> int:
        """Rows a lane batches under load: its share of `batch`, as `Service` gives it."""
        return max(2, self.batch // lanes) if lanes > 1 else self.batch

    def _step_s(self, plan: ShardPlan, threads: int, rows: int, workers: int) -> float:
        """Seconds of one step of `rows` rows through every stage of `plan` in turn."""
        costs = self.block_costs(plan.stages[0].device, threads, rows=rows, **self._sharing(workers, threads))
        return sum(self._stage_seconds(plan, costs, rows)) * self._stretch(workers, threads)

    def _lone_step(self, plan: ShardPlan, replicas: int, threads: int) -> tuple[float, bool, int]:
        """Seconds of one step of a lone image (`lone_rows` rows), whether it goes to the idle
        replicas too (predicted quicker than one replica), and as a sequence group of how many
        ranks (1: its rows split, a row each, at once)."""
        rows = self.lone_rows
        options = [(self._step_s(plan, threads, rows, workers=1), False, 1)]
        if replicas > 1 and rows > 1:
            options.append((self._step_s(plan, threads, max(1, rows // replicas), workers=replicas), True, 1))
        if replicas > 1 and self.split:
            options.append((self._group_s(plan, threads, rows, replicas), True, replicas))
        if self.grouped:  # every call is a group: a lone one too
            return options[-1]
        return min(options, key=lambda option: option[0])

    def _sharing(self, workers: int, threads: int) -> dict[str, Any]:
        """How busy CPU workers share the host, for the cost model (nothing on GPUs)."""
        if not self.all_cpu:
            return {}
        return {"workers": workers, "beside_server": workers * threads >= self.quota}

    def _stage_seconds(self, plan: ShardPlan, costs: Mapping[str, float], rows: int) -> list[float]:
        # boundaries are sized for `batch` rows at the largest latent; a copy moves `rows` at this one
        share = rows / plan.batch * (self.latent / plan.latent_size) ** 2
        out = []
        for index, stage in enumerate(plan.stages):
            seconds = sum(costs[block] for block in stage.blocks)
            if index > 0 and plan.stages[index - 1].device != stage.device:
                rate = BOUNDARY_BYTES_PER_S
                if stage.device.startswith("cuda"):  # between GPUs: no faster than their link
                    rate = min(rate, self.links(stage.device, 1).bytes_per_s)
                seconds += plan.boundaries[index - 1].bytes * share / rate
            out.append(seconds)
        return out
