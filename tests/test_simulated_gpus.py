"""The multi-GPU modes run whole requests on simulated GPUs with data (issue 68:
`server/engine/hardware/simulated.py`): `cuda:0 … cuda:N-1` backed by CPU memory, with CUDA's
same-device rule, per-device budgets and counters. Each mode's image or video equals one
device's within 2/255 (float32 here: the CPU kernels are the same, so mostly exactly); a Wan 2.2
two-expert folder served with `--parallel experts` under `DIFFSHARD_SIMULATED_GPUS=2`; GPU
replicas loaded without a host copy per replica; no device-wide synchronization on the step path,
and helper threads calling only on the device they set; `plan` on simulated GPUs as on budgets
of the same size.

The simulation is the boundary faked here: this host has no CUDA. What it cannot show (speed,
streams, cuBLAS' numerics) is said in its module."""

from __future__ import annotations

import gc
import io
import json
import threading
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from server.demo import MODEL_DIR
from server.engine.hardware import simulated
from server.engine.runtime.replicas import build_shards
from server.engine.runtime.sequence import Group
from server.pipeline import Pipeline
from server.pipeline.loading.folder import read_family
from server.pipeline.loading.model_plan import plan_model
from server.requests import GenerationRequest
from server.serving import Service
from tests.support.built_in import rows_of_every_kind, with_make_run_parts
from tests.support.live import live_server
from tests.support.tiny_pipelines import build_flux_folder, build_sd3_folder, build_sd15_folder
from tests.support.tiny_wan22 import wan_video
from tests.support.waiting import wait_until

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

IMAGE = GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=4, width=32, height=32)
VIDEO = GenerationRequest(
    "a red circle",
    negative_prompt="blue",
    seed=3,
    steps=6,
    guidance_scale=4.0,
    guidance_scale_2=2.0,
    width=32,
    height=32,
    frames=9,
)
BUILDERS: dict[str, Callable[[Path], Path]] = {
    "sd15": build_sd15_folder,
    "flux": build_flux_folder,
    "sd3": build_sd3_folder,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tiny_folder) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            builder = BUILDERS.get(name)
            made[name] = builder(tmp_path_factory.mktemp(name) / name) if builder else tiny_folder(name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def one_device(folder) -> Callable[[str, GenerationRequest], np.ndarray]:
    """What `--devices cpu` gives for a folder and request (cached)."""
    made: dict[tuple[str, str], np.ndarray] = {}

    def get(name: str, request: GenerationRequest) -> np.ndarray:
        key = (name, repr(request))
        if key not in made:
            pipeline = Pipeline.load(folder(name), devices="cpu")
            made[key] = pipeline.generate([pipeline.resolve(request)])[0]
        return made[key]

    return get


@pytest.fixture
def gpus(request: pytest.FixtureRequest) -> Iterator[simulated.Simulation]:
    with simulated.simulate(getattr(request, "param", 2)) as sim:
        yield sim


def planned(folder: Path, devices: list[str], parallel: str = "auto", layout: str | None = None) -> Pipeline:
    plan = plan_model(
        read_family(folder),
        devices,
        "memory",
        dtype=torch.float32,
        batch=4,
        side=32,
        folder=folder,
        parallel=parallel,
        layout=layout,
    )
    return Pipeline.load(folder, plan=plan)


def each_lane(pipeline: Pipeline, request: GenerationRequest) -> list[np.ndarray]:
    """The request made on every lane (each replica or group), one after another."""
    lanes = pipeline.lanes() if len(pipeline.replicas) > 1 else [pipeline]
    return [lane.generate([lane.resolve(request)])[0] for lane in lanes]


def worst(images: list[np.ndarray], reference: np.ndarray) -> float:
    return max(float(np.abs(image - reference).max()) for image in images)


def test_wan22_experts_apart_on_two_gpus_make_one_devices_video(folder, one_device, gpus) -> None:
    """`--parallel experts` (auto's pick for A14B on two GPUs): the low-noise expert predicts on
    cuda:1 and the scheduler steps on cuda:0's latents; it failed at the first low-noise step
    ("Expected all tensors to be on the same device")."""
    pipeline = planned(folder("wan2.2-a14b"), ["cuda:0", "cuda:1"], "experts")
    first, second = (d.replicas[0] for d in pipeline.experts)
    assert (first.devices, second.devices) == (["cuda:0"], ["cuda:1"])
    video = pipeline.generate([pipeline.resolve(VIDEO)])[0]
    assert worst([video], one_device("wan2.2-a14b", VIDEO)) <= 2 / 255
    assert all(gpu.peak > 0 for gpu in gpus.gpus)  # each expert ran on its own GPU


MODES = [
    ("sd15", "pipeline"),
    ("sd15", "replicas"),
    ("sd15", "tensor"),
    ("flux", "pipeline"),
    ("flux", "replicas"),
    ("flux", "sequence"),
    ("flux", "tensor"),
    ("sd3", "pipeline"),
    ("sd3", "replicas"),
    ("sd3", "sequence"),
    ("sd3", "tensor"),
]


@pytest.mark.parametrize(("name", "mode"), MODES, ids=[f"{n}-{m}" for n, m in MODES])
def test_every_mode_on_two_gpus_makes_one_devices_image(folder, one_device, gpus, name, mode) -> None:
    """Scheduler steps and decoding included, on every lane; no device-wide sync while stepping,
    and helper threads (ranks, micro-batches) call only on the device they set."""
    pipeline = planned(folder(name), ["cuda:0", "cuda:1"], mode)
    gpus.reset_counts()
    images = each_lane(pipeline, IMAGE)
    pipeline.synchronize()  # as the step loop does after every call
    assert worst(images, one_device(name, IMAGE)) <= 2 / 255
    assert gpus.syncs == [], gpus.syncs
    helpers = {key: n for key, n in gpus.foreign.items() if key[0].startswith("diffshard-micro")}
    assert helpers == {}, helpers


@pytest.mark.parametrize("mode", ["pipeline", "sequence", "tensor"])
def test_served_steps_never_sync_a_whole_gpu_and_each_call_runs_on_its_threads_device(
    folder, one_device, gpus, mode
) -> None:
    """Through the step loops (a lane per replica or group, helper threads for ranks): three
    requests at once, each the image it makes alone; not one `torch.cuda.synchronize` (a lane
    waits on events for its own work), and every call a lane's or a helper's thread makes runs
    on the device it set (a pipelined lane sets each stage's as it enters it)."""
    pipeline = planned(folder("flux"), ["cuda:0", "cuda:1"], mode)
    service = Service(pipeline, mode, max_batch=4)
    try:
        gpus.reset_counts()
        seeds = (3, 4, 5)
        jobs = [service.submit([pipeline.resolve(replace(IMAGE, seed=seed))]) for seed in seeds]
        images = [job.future.result(timeout=120)[0] for job in jobs]
    finally:
        service.close()
    assert worst(images[:1], one_device("flux", IMAGE)) <= 2 / 255
    assert gpus.syncs == [], gpus.syncs
    wandering = {key: n for key, n in gpus.foreign.items() if key[0].startswith("diffshard")}
    assert wandering == {}, wandering


def test_a_pipelined_lane_waits_on_the_stage_it_left_only_for_its_own_work(folder, gpus) -> None:
    """After a call through stages on cuda:0 then cuda:1, the lane waits on cuda:1 for the event
    its walk recorded as it left that stage (before its gate let the next lane in), and on cuda:0,
    where the scheduler steps its latents, for one recorded then. An event recorded on cuda:1 at
    the end waited for the next lane's work there too: pipelined lanes serialized."""
    pipeline = planned(folder("flux"), ["cuda:0", "cuda:1"], "pipeline")
    assert [s.device for s in pipeline.shard.plan.stages] == ["cuda:0", "cuda:1"]
    states = pipeline.start([pipeline.resolve(IMAGE)])
    pipeline.step(states)
    gpus.reset_counts()
    pipeline.synchronize()
    where = {device: recorded.split(":")[0] for device, recorded, _ in gpus.waited}
    assert where == {0: "devices.py", 1: "walker.py"}, gpus.waited


def test_a_lane_leaves_a_stage_with_its_boundary_copy_already_queued(folder, gpus) -> None:
    """The copy of the flow to the next stage's GPU is made while the stage is still this call's:
    queued after the lane's own kernels there, never behind the next lane's, which may enter as
    soon as the gate is free (it was made after, on the next stage's side)."""
    pipeline = planned(folder("flux"), ["cuda:0", "cuda:1"], "pipeline")
    states = pipeline.start([pipeline.resolve(IMAGE)])
    gates, seen = pipeline.shard.gates, []
    leave = gates.leave

    def watched(stage: int) -> None:  # what cuda:1 holds as the lane lets the next one in
        seen.append((stage, gpus.gpus[1].allocated))
        leave(stage)

    gates.leave = watched
    before = gpus.gpus[1].allocated
    pipeline.step(states)
    assert seen[0][0] == 0 and seen[0][1] > before  # the flow's tensors already on cuda:1


def test_a_text_encoder_spread_over_two_gpus_gives_every_hidden_state_on_the_first(gpus) -> None:
    """A tensor group's largest text encoder spread layer by layer (`parts.spread_encoder`), as
    FLUX.2-dev's Mistral 3 needs on two 80 GiB GPUs: FLUX.2 reads three layers' hidden states and
    stacks them, each back on the first GPU with the numbers of the encoder whole on the CPU; each
    layer on the second runs with its GPU set, and the thread's own device is back after."""
    import copy

    from server.pipeline.loading.parts import layer_devices, spread_encoder
    from tests.support.tiny_flux2 import _mistral3, build_mistral_tokenizer

    tokenizer = build_mistral_tokenizer()
    torch.manual_seed(0)
    encoder = _mistral3(tokenizer).eval()
    whole = copy.deepcopy(encoder)
    path, places = layer_devices(encoder, ["cuda:0", "cuda:1"])
    assert path == "model.language_model.layers" and list(places.values()) == sorted(places.values())
    total = sum(p.nbytes for p in encoder.parameters())
    layer = max(sum(p.nbytes for p in m.parameters()) for m in encoder.model.language_model.layers)
    spread_encoder(encoder, ["cuda:0", "cuda:1"])
    second = sum(p.nbytes for p in encoder.parameters() if p.device.index == 1)
    assert abs(second - total / 2) <= layer  # half the bytes on each, within a layer
    tokens = tokenizer(["a red circle"], return_tensors="pt")
    gpus.reset_counts()
    with torch.inference_mode():
        states = [
            model.model(
                input_ids=tokens["input_ids"].to(device),
                attention_mask=tokens["attention_mask"].to(device),
                output_hidden_states=True,
                use_cache=False,
            ).hidden_states
            for model, device in ((encoder, "cuda:0"), (whole, "cpu"))
        ]
    stacked = torch.stack([states[0][k] for k in (10, 20, 30)], dim=2)
    assert stacked.device == torch.device("cuda:0")
    assert torch.allclose(stacked.cpu(), torch.stack([states[1][k] for k in (10, 20, 30)], dim=2), atol=1e-5)
    assert gpus.foreign == {} and torch.cuda.current_device() == 0


def test_a_text_encoder_converted_where_it_lives_holds_one_layer_at_a_time_in_its_first_dtype(gpus) -> None:
    """`--quantize float8`'s encoders convert on their GPU (`Quantization.placing`), now piece by
    piece as each is placed: the GPU's peak is the converted encoder and one piece unconverted,
    not the whole encoder in its first dtype (which the plan never counted). A bfloat16 cast of a
    float32 encoder stands in for the conversion (torchao's tensors do not run simulated)."""
    from server.pipeline.loading.parts import spread_encoder
    from tests.support.tiny_flux2 import _mistral3, build_mistral_tokenizer

    torch.manual_seed(0)
    encoder = _mistral3(build_mistral_tokenizer()).eval()
    whole = sum(t.nbytes for t in (*encoder.parameters(), *encoder.buffers()))
    pieces: list[str] = []

    def converts(part: torch.nn.Module, path: str) -> None:
        part.to(torch.bfloat16)
        pieces.append(path)

    spread_encoder(encoder, ["cuda:0"], converts)
    assert {p.dtype for p in encoder.parameters()} == {torch.bfloat16}
    assert len(pieces) > 3 and gpus.gpus[0].peak < 0.75 * whole, (gpus.gpus[0].peak, whole)


def built_in(devices: list[str], parallel: str) -> Pipeline:
    """The built-in model with `make run`'s adapter and ControlNet."""
    if devices == ["cpu"]:
        return with_make_run_parts(Pipeline.load(MODEL_DIR, devices="cpu"))
    plan = plan_model(
        read_family(MODEL_DIR),
        devices,
        "memory",
        dtype=torch.float32,
        batch=8,
        side=64,
        folder=MODEL_DIR,
        parallel=parallel,
    )
    return with_make_run_parts(Pipeline.load(MODEL_DIR, plan=plan))


@pytest.fixture(scope="module")
def every_kind_on_the_cpu() -> list[np.ndarray]:
    return built_in(["cpu"], "off").generate(rows_of_every_kind())


@pytest.mark.parametrize("mode", ["pipeline", "replicas"])
def test_lora_controlnet_cached_and_edit_rows_on_two_gpus_make_one_devices_images(
    gpus, every_kind_on_the_cpu, mode
) -> None:
    """The built-in model as `make run` serves it, its rows of every kind in one batch."""
    requests = rows_of_every_kind()
    images = built_in(["cuda:0", "cuda:1"], mode).generate(requests)
    for image, expected, request in zip(images, every_kind_on_the_cpu, requests, strict=True):
        assert float(np.abs(image - expected).max()) <= 2 / 255, request
    assert all(gpu.peak > 0 for gpu in gpus.gpus)


def steps_waited(pipeline: Pipeline, requests: list[GenerationRequest], gpus: simulated.Simulation) -> dict:
    """Started and stepped once (diffusers' rotary tables go to a GPU at a model's first call),
    then stepped to the end: what those steps made the host wait for (reads of device values,
    copies from host memory that wait for the stream, device-wide syncs), by kind."""
    states = pipeline.start([pipeline.resolve(r) for r in requests])
    pipeline.step(states)
    gpus.reset_counts()
    while running := [s for s in states if not s.done]:
        pipeline.step(running)
    return {"reads": dict(gpus.reads), "uploads": dict(gpus.uploads), "syncs": gpus.syncs}


@pytest.mark.parametrize("mode", ["pipeline", "replicas"])
def test_steps_of_every_kind_of_row_never_make_the_host_wait(gpus, mode) -> None:
    """LoRA masks, ControlNet row indices, a step cache's refreshed rows: made from pinned host
    memory, queued; the schedule on the host (DDIM read `alphas_cumprod[t]` and `t >= 0` on the
    GPU, ~5 reads a row a step). They were 30 blocking copies and 92 reads in these 4 steps."""
    pipeline = built_in(["cuda:0", "cuda:1"], mode)
    assert steps_waited(pipeline, rows_of_every_kind(), gpus) == {"reads": {}, "uploads": {}, "syncs": []}


@pytest.mark.parametrize("name", ["qwen-image", "z-image"])
def test_steps_of_prompts_of_other_lengths_never_make_the_host_wait(folder, gpus, name) -> None:
    """Qwen-Image and Z-Image read their prompts' lengths once as a request starts (their calls'
    text columns cut on the host): read from the mask in the denoiser, a read every call."""
    pipeline = planned(folder(name), ["cuda:0", "cuda:1"], "pipeline")
    requests = [replace(IMAGE, prompt="a red circle " * n, seed=n) for n in (1, 9)]
    assert steps_waited(pipeline, requests, gpus) == {"reads": {}, "uploads": {}, "syncs": []}


def test_unet_refuses_sequence_groups_by_name(folder, gpus) -> None:
    from server.errors import PlanError

    with pytest.raises(PlanError, match="use replicas or pipeline"):
        planned(folder("sd15"), ["cuda:0", "cuda:1"], "sequence")


@pytest.mark.parametrize("gpus", [4], indirect=True)
@pytest.mark.parametrize(("name", "layout"), [("flux", "1x2x2"), ("sd3", "2x1x2"), ("sd3", "1x1x4")])
def test_layouts_on_four_gpus_make_one_devices_image(folder, one_device, gpus, name, layout) -> None:
    """Replicas × sequence × tensor ranks; `1x1x4` a tensor group of 4 (the tiny MMDiT's 4 heads)."""
    pipeline = planned(folder(name), [f"cuda:{i}" for i in range(4)], layout=layout)
    assert sorted(d for r in pipeline.replicas for d in r.devices) == [f"cuda:{i}" for i in range(4)]
    if layout == "1x1x4":  # four ranks, each a quarter of every block's heads and features
        assert len(pipeline.replicas) == 4 and all(r.tensor is not None for r in pipeline.replicas)
    images = each_lane(pipeline, IMAGE)
    assert worst(images, one_device(name, IMAGE)) <= 2 / 255
    assert all(gpu.peak > 0 for gpu in gpus.gpus)


def test_a_gpu_and_the_cpu_as_replicas_make_one_devices_image(folder, one_device, gpus) -> None:
    """`cuda:0,cpu`: the CPU replica shares no Parameter with the model the GPU replica moves."""
    pipeline = planned(folder("sd15"), ["cuda:0", "cpu"], "replicas")
    assert [s.devices for s in pipeline.replicas] == [["cuda:0"], ["cpu"]]
    assert worst(each_lane(pipeline, IMAGE), one_device("sd15", IMAGE)) <= 2 / 255


def host_tensor_bytes(sim: simulated.Simulation) -> int:
    """Bytes of the CPU tensors alive (weights and their copies), less the simulated GPUs' own.
    Strided ones only: oneDNN's packed weights (an earlier test's frozen compile) have no storage."""
    plain = [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)]
    tensors = [t for t in plain if t.layout == torch.strided]
    return sum(t.nbytes for t in tensors if not sim.holds(t))


def test_two_gpu_replicas_load_without_a_host_copy_each(folder, gpus) -> None:
    """Host bytes of tensors, read as each block reaches its GPU, stay within 1.3× one replica's
    weights (they were 2×: every replica deep-copied on the host before any was placed)."""
    folder_ = folder("flux")
    family = read_family(folder_)
    plan = plan_model(
        family,
        ["cuda:0", "cuda:1"],
        "memory",
        dtype=torch.float32,
        batch=4,
        side=32,
        folder=folder_,
        parallel="replicas",
    )
    model = Pipeline.load(folder_, devices="cpu").components.denoiser
    one = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    before = host_tensor_bytes(gpus) - one
    readings: list[int] = []
    shards = build_shards(model, plan, lambda module, path: readings.append(host_tensor_bytes(gpus) - before))
    assert [s.devices for s in shards] == [["cuda:0"], ["cuda:1"]]
    assert readings and max(readings) <= 1.3 * one, (max(readings), one)
    assert gpus.gpus[0].allocated >= one and gpus.gpus[1].allocated >= one


def test_an_exchange_drops_each_ranks_value_once_every_rank_has_read_it() -> None:
    group = Group([torch.device("cpu")])
    first = torch.ones(4)
    held = [first]
    import weakref

    alive = weakref.ref(first)
    group.all_gather(0, 0, first)
    del first, held
    group.all_gather(0, 1, torch.zeros(4))
    assert alive() is None  # not kept on through the next exchange


def test_an_exchange_refuses_a_rank_off_its_gpus_default_stream(gpus) -> None:
    """Peers read a rank's value once the barrier says it is made: true only on the default
    stream, so another is refused rather than read early."""
    group = Group([torch.device("cuda:0")])
    value = torch.ones(2, device="cuda:0")
    with torch.cuda.stream(torch.cuda.Stream("cuda:0")), pytest.raises(RuntimeError, match="default stream"):
        group.all_gather(0, 0, value)
    assert group.all_gather(0, 1, value)[0] is value


def test_served_wan22_experts_on_simulated_gpus(folder, one_device) -> None:
    """`DIFFSHARD_SIMULATED_GPUS=2 serve --devices cuda:0,cuda:1 --parallel experts`: a video
    job over OpenAI's SDK completes with one device's frames (within 2/255)."""
    a14b = folder("wan2.2-a14b")
    env = {simulated.ENV: "2x4GiB"}
    args = ("--model", str(a14b), "--devices", "cuda:0,cuda:1", "--parallel", "experts", "--dtype", "float32")
    with live_server(*args, env=env) as server:
        assert any("simulating 2 CUDA device" in line for line in server.log)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        body = {
            "num_frames": 9,
            "num_inference_steps": 6,
            "seed": 3,
            "guidance_scale": 4.0,
            "guidance_scale_2": 2.0,
            "negative_prompt": "blue",
        }
        video_id = client.videos.create(prompt="a red circle", size="32x32", extra_body=body).id
        done = wait_until(
            lambda: (v := client.videos.retrieve(video_id)).status in ("completed", "failed") and v,
            120,
            "the video job finished",
        )
        assert done.status == "completed", done.error
        archive = client.videos.download_content(video_id, variant="frames").read()
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        frames = np.stack([np.asarray(Image.open(io.BytesIO(z.read(n)))) for n in sorted(z.namelist())])
    theirs = (wan_video(a14b, VIDEO) * 255).round().astype(int)
    assert int(np.abs(frames.astype(int) - theirs).max()) <= 2


def test_plan_on_simulated_gpus_is_the_plan_on_budgets_of_their_size(folder, run_cli) -> None:
    """The same plan, word for word but for where the devices are said to be."""
    args = (
        "plan",
        "--model",
        str(folder("flux")),
        "--devices",
        "cuda:0,cuda:1",
        "--max-memory",
        "cuda:0=18GiB,cuda:1=18GiB",
    )
    absent = run_cli(*args)
    on_simulated = run_cli(*args, env={simulated.ENV: "2x20GiB"})
    assert absent.returncode == 0 == on_simulated.returncode, on_simulated.stderr
    assert "simulating 2 CUDA device(s) of 20 GiB" in on_simulated.stderr
    said = on_simulated.stdout.replace("simulated in CPU memory", "not on this host")
    assert said == absent.stdout


def test_plan_says_when_gpus_cannot_reach_each_other_and_prices_their_copies_through_the_host(
    folder, run_cli
) -> None:
    """Simulated without peer access (`,no-p2p`: GeForce cards, many VMs), a tensor group's
    exchanges go through the host: predicted slower, and the plan says why."""
    args = ("plan", "--model", str(folder("flux")), "--devices", "cuda:0,cuda:1", "--json")
    said = {spec: run_cli(*args, env={simulated.ENV: spec}) for spec in ("2x20GiB", "2x20GiB,no-p2p")}
    assert all(r.returncode == 0 for r in said.values()), said
    plans = {spec: json.loads(r.stdout) for spec, r in said.items()}
    costs = {spec: plan["parallel"]["costs"] for spec, plan in plans.items()}
    assert "no peer access between cuda:0 and cuda:1" in costs["2x20GiB,no-p2p"]
    assert "use peer access (P2P)" in costs["2x20GiB"]

    def tensor_rows(plan: dict) -> float:
        candidates = plan["parallel"]["candidates"]
        return next(c["predicted_rows_per_s"] for c in candidates if c["tensor_degree"] == 2)

    assert tensor_rows(plans["2x20GiB,no-p2p"]) < 0.6 * tensor_rows(plans["2x20GiB"])


def test_simulated_gpus_hold_cudas_rules(gpus) -> None:
    """The rules the tests above lean on: one device an op, a budget a device, threads' own
    devices, syncs and host reads counted."""
    a, b = torch.ones(3, device="cuda:0"), torch.ones(3, device="cuda:1")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3)
    assert torch.equal((a + torch.tensor(1.0)).cpu(), torch.full((3,), 2.0))  # a CPU scalar passes
    assert (a + b.to("cuda:0")).device == torch.device("cuda:0")
    before = gpus.gpus[1].allocated
    c = torch.zeros(256, device="cuda:1")
    assert gpus.gpus[1].allocated == before + 1024 and torch.cuda.memory_allocated(1) == before + 1024
    del c
    assert gpus.gpus[1].allocated == before
    gpus.reset_counts()
    float(a.sum())
    torch.cuda.synchronize()
    assert gpus.reads["MainThread"] == 1 and len(gpus.syncs) == 1

    def helper() -> None:
        with torch.cuda.device(1):
            b * 2
        b * 2  # device 0 is a new thread's current device

    thread = threading.Thread(target=helper, name="helper")
    thread.start()
    thread.join()
    assert gpus.foreign == {("helper", "cuda:1", "cuda:0"): 1}


def test_the_pools_idle_gpu_budget_stays_inside_the_planners_margin() -> None:
    """2% of a GPU, at most 1 GiB, idle in the activation pool: inside the 10% the plan leaves
    free (at 10% the pool could hold all of it idle, uncounted)."""
    from server.engine.runtime.pool import default_pool_budgets

    with simulated.simulate(2, 24 * 2**30):
        budgets = default_pool_budgets(["cuda:0", "cuda:1"])
    assert budgets["cuda:0"] == budgets["cuda:1"] == int(0.02 * 24 * 2**30)
    with simulated.simulate(1, 141 * 2**30):
        assert default_pool_budgets(["cuda:0"])["cuda:0"] == 2**30


def test_a_simulated_gpus_budget_is_its_memory() -> None:
    with simulated.simulate(1, 2**20):
        kept = torch.empty(2**19, dtype=torch.uint8, device="cuda:0")
        assert torch.cuda.mem_get_info(0) == (2**19, 2**20)
        with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory\. Tried to allocate 0\.75 MiB"):
            torch.empty(3 * 2**18, dtype=torch.uint8, device="cuda:0")
        assert kept.device == torch.device("cuda:0")
