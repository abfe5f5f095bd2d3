"""Compiled denoisers: every family's images through compiled buckets equal the eager ones
within 1e-3 (float32), on one stage (`full`) and split over two (`blocks`); a call no bucket
holds runs eagerly and is counted; a second start loads the graphs from the cache, and a
corrupt cache file is compiled again with a warning, never fatal. The just-in-time route (a
PyTorch without `aot_compile`) gives eager's images too, and a restart of `serve` on it is ready
sooner than its first start.

Compiling is slow on a CPU (seconds per graph even for these tiny models), so each test warms
one bucket (2 rows, one image); the inductor kernel cache the first test fills is shared."""

from __future__ import annotations

import json
import logging
import multiprocessing
import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from server.engine import CallPlan
from server.engine.runtime import graphs
from server.engine.runtime.compile import CompileMode
from server.engine.runtime.graphs import CompileStats, GraphStore
from server.engine.runtime.tracing import trace_gate
from server.pipeline import Pipeline
from server.pipeline.conditioning.adapters import Adapter, LoraPair
from server.pipeline.loading.warmup import Verdicts, compile_pipeline
from server.requests import Edit, GenerationRequest
from server.requests.step_cache import StepCache
from tests.support.tiny_pipelines import IMAGE_SIZE

TOLERANCE = 1e-3
CACHES = {
    "sd15": StepCache("deep", interval=2),
    "sd3": StepCache("first_block", threshold=0.5),
}
GUIDED = GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=3, guidance_scale=4.0)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compiled")


def _images(pipeline: Pipeline, requests: list[GenerationRequest]) -> list[np.ndarray]:
    return pipeline.generate(requests)


def calls_of(pipeline: Pipeline, request: GenerationRequest) -> int:
    """The denoiser calls `request` takes: one a timestep of its scheduler (SD 1.5's PNDM, as its
    published folders ship it, runs its first timestep twice)."""
    (state,) = pipeline.start([pipeline.resolve(request)])
    state.close()
    return state.steps


def compiled_equals_eager(
    pipeline: Pipeline, mode: CompileMode, family: str, cache_dir: Path
) -> CompileStats:
    """Compiles `pipeline` (one bucket: 2 rows at IMAGE_SIZE) and checks its images, plain and
    step-cached, equal eager ones; its stats."""
    eager = _images(pipeline, [GUIDED])[0]
    cached = replace(GUIDED, step_cache=CACHES[family])  # step-cached rows run compiled blocks too
    eager_cached = _images(pipeline, [cached])[0]
    stats = compile_pipeline(pipeline, mode, [IMAGE_SIZE], 2, cache_dir)
    assert stats.graphs_ready == stats.graphs_total > 0
    assert np.abs(_images(pipeline, [GUIDED])[0] - eager).max() < TOLERANCE
    assert stats.calls == {"compiled": calls_of(pipeline, GUIDED), "padded": 0, "eager": 0}, stats.calls
    assert np.abs(_images(pipeline, [cached])[0] - eager_cached).max() < TOLERANCE
    # full: a cached call cannot take the whole-call graph; blocks: every block a graph
    path = "compiled" if mode == CompileMode.BLOCKS else "eager"
    assert stats.calls[path] == calls_of(pipeline, GUIDED) * (1 + (path == "compiled")), stats.calls
    return stats


def test_compiled_blocks_over_two_stages_equal_eager_ones(sd3_folder: Path, cache_dir: Path) -> None:
    """SD3's blocks, each a graph, over two stages (SD-1.5's whole UNet as one graph: below).
    SDXL's full graph (28 s on 2 cores) is left out for the suite's time: its UNet adds only
    conditioning inputs to SD-1.5's, which the eager tests cover."""
    pipeline = Pipeline.load(sd3_folder, devices="cpu,cpu", strategy="even")
    assert len(pipeline.shard.plan.stages) == 2
    compiled_equals_eager(pipeline, CompileMode.BLOCKS, "sd3", cache_dir)


def test_flux3s_mode_blocks_compile_apart_and_a_padded_call_or_an_edit_stays_exact(
    tiny_folder, tmp_path
) -> None:
    """FLUX.3's three modes' blocks share a structure but not a call: each compiles its own graph
    (one graph for all three changed the image). A guided call (2 rows) and an unguided one
    padded to them run compiled; an edit, whose rows carry references no text warm-up has (and
    whose reference blocks are never warmed), runs eagerly; each equals eager (1e-5)."""
    from tests.support.tiny_flux3 import reference_image

    pipeline = Pipeline.load(tiny_folder("flux3"), devices="cpu")
    guided = pipeline.resolve(replace(GUIDED, width=32, height=32))
    lone = pipeline.resolve(replace(guided, guidance_scale=1.0))
    edit = pipeline.resolve(
        GenerationRequest("make it blue", seed=5, steps=3, edit=Edit(reference_image(32)))
    )
    eager = [_images(pipeline, [r])[0] for r in (guided, lone, edit)]
    # its own cache dir: the tests after it count the module's files
    stats = compile_pipeline(pipeline, CompileMode.BLOCKS, [32], 2, tmp_path)
    # the embedding, the prompt's and the image's 2 blocks each, 2 joint blocks, the output; the decoder
    assert stats.graphs_ready == stats.graphs_total == 9
    for request, expected in zip((guided, lone, edit), eager, strict=True):
        assert np.abs(_images(pipeline, [request])[0] - expected).max() < 1e-5
    assert stats.calls == {"compiled": 3, "padded": 3, "eager": 3}, stats.calls


@pytest.mark.parametrize("mode", [CompileMode.BLOCKS, CompileMode.FULL])
def test_qwen_image_21_compiles_the_calls_on_a_kept_prefix_and_runs_its_first_eagerly(
    tiny_folder, tmp_path, mode
) -> None:
    """Qwen-Image 2.1 warms from a request's later calls (on its kept prefix keys and values):
    those run compiled, a request's first call (its prefix laid out on the host) eagerly, and
    the image equals eager (1e-5). The warm-up's own first call is not counted."""
    pipeline = Pipeline.load(tiny_folder("qwen-image-2.1"), devices="cpu")
    request = pipeline.resolve(replace(GUIDED, width=32, height=32))
    (eager,) = _images(pipeline, [request])
    stats = compile_pipeline(pipeline, mode, [32], 2, tmp_path / mode.value)
    assert stats.graphs_ready == stats.graphs_total
    assert np.abs(_images(pipeline, [request])[0] - eager).max() < 1e-5
    assert stats.calls["compiled"] == 2 and stats.calls["eager"] == 1, stats.calls


def test_a_background_compile_serves_eagerly_meanwhile_then_compiled_beside_adapter_rows(
    folders: dict[str, Path], cache_dir: Path
) -> None:
    """`background=True` (how the server compiles): it returns before any graph is built; calls
    run eagerly meanwhile, then through the graphs. With an adapter attached before it (as
    `--lora`'s are), adapter rows run eagerly and plain rows compiled, each as it was; an
    img2img edit's steps run compiled and equal its eager image.
    Then the counts of a call no bucket holds (below)."""
    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    layer = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    width = pipeline.shard.model.get_submodule(layer).in_features
    torch.manual_seed(0)
    pair = LoraPair(torch.randn(2, width), torch.randn(width, 2), alpha=2.0)
    pipeline.add_adapter(Adapter("red", Path("red.safetensors"), {"unet": {layer: pair}}))
    adapted = replace(GUIDED, lora=(("red", 1.0),))
    picture = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (20, 20, 30))
    ImageDraw.Draw(picture).ellipse((4, 4, IMAGE_SIZE - 8, IMAGE_SIZE - 4), fill=(220, 30, 30))
    edited = replace(GUIDED, edit=Edit(picture, None, 0.7))  # img2img: its steps from a later one
    eager, eager_adapted, eager_edited = _images(pipeline, [GUIDED, adapted, edited])
    switch = sys.getswitchinterval()
    stats = compile_pipeline(pipeline, CompileMode.FULL, [IMAGE_SIZE], 2, cache_dir, background=True)
    assert stats.state == "compiling" and stats.graphs_ready < max(1, stats.graphs_total)
    with trace_gate().call():  # as the service's step calls run: never beside an export's trace
        assert np.abs(_images(pipeline, [GUIDED])[0] - eager).max() < TOLERANCE  # eager meanwhile
    assert stats.done.wait(timeout=600) and stats.state == "ready", stats.view()
    assert stats.frozen == 2  # one stage on a CPU: the UNet's and the decoder's weights folded in
    assert sys.getswitchinterval() == switch  # shortened while it compiled, then given back
    before = dict(stats.calls)
    assert np.abs(_images(pipeline, [GUIDED])[0] - eager).max() < TOLERANCE
    assert np.abs(_images(pipeline, [adapted])[0] - eager_adapted).max() < TOLERANCE
    calls = {path: stats.calls[path] - before[path] for path in before}
    steps = calls_of(pipeline, GUIDED)
    assert calls == {"compiled": steps, "padded": 0, "eager": steps}, calls
    compiled_before = stats.calls["compiled"]
    assert np.abs(_images(pipeline, [edited])[0] - eager_edited).max() < TOLERANCE  # an edit, compiled
    assert stats.calls["compiled"] > compiled_before
    # attached after the graphs were built (as POST /v1/adapters does), then detached: its rows
    # run eagerly as an uncompiled pipeline's; plain rows, compiled, are as before
    blue = Adapter("blue", Path("blue.safetensors"), {"unet": {layer: LoraPair(pair.up.T, pair.down.T, 2.0)}})
    uncompiled = Pipeline.load(folders["sd15"], devices="cpu")
    for each in (pipeline, uncompiled):
        each.add_adapter(blue)
    asked = replace(GUIDED, lora=(("blue", 1.0),))
    assert np.abs(_images(pipeline, [asked])[0] - _images(uncompiled, [asked])[0]).max() < TOLERANCE
    pipeline.adapters.remove("blue")
    compiled_before = stats.calls["compiled"]
    assert np.abs(_images(pipeline, [GUIDED])[0] - eager).max() < TOLERANCE
    assert stats.calls["compiled"] == compiled_before + calls_of(pipeline, GUIDED)
    calls_no_bucket_holds_run_eagerly_and_are_counted(pipeline, stats)


def test_auto_keeps_a_buckets_graphs_only_where_its_calls_were_faster_int8_weights_frozen_too(
    folders: dict[str, Path], cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--compile auto` on one stage compiles the whole call, times the bucket's calls both ways,
    and serves it compiled only if that was faster. Its weights here are `--quantize int8`'s: on a
    CPU they freeze too (inductor folds the quantized weights), and draw their eager images. A
    restart takes a clear verdict kept in the cache directory instead of timing again (here one
    recorded as clearly slower: its graphs go unused), and times a close one again once every
    graph is ready, serving through its graphs meanwhile."""
    pipeline = Pipeline.load(folders["sd15"], devices="cpu", quantize="int8")
    eager = _images(pipeline, [GUIDED])[0]
    with caplog.at_level(logging.WARNING, logger="diffshard"):
        stats = compile_pipeline(pipeline, CompileMode.AUTO, [IMAGE_SIZE], 2, cache_dir)
    assert (stats.mode, stats.state) == ("auto: full", "ready"), stats.view()
    assert "cannot freeze" not in caplog.text
    bucket, decoder = stats.buckets  # 2 rows at IMAGE_SIZE, and the decoder's one image
    assert bucket["bucket"] == f"{IMAGE_SIZE}px × 2 rows" and decoder["bucket"].startswith("decoder")
    assert all(b["kept"] == (b["compiled_ms"] < b["eager_ms"]) and b["timed"] for b in stats.buckets)
    assert stats.frozen == sum(b["kept"] for b in stats.buckets)  # every graph kept is a frozen one
    assert np.abs(_images(pipeline, [GUIDED])[0] - eager).max() < TOLERANCE
    path = "compiled" if bucket["kept"] else "eager"
    steps = calls_of(pipeline, GUIDED)
    assert stats.calls[path] == steps and sum(stats.calls.values()) == steps, stats.calls

    recorded = cache_dir / "compiled" / "verdicts.json"
    verdicts = json.loads(recorded.read_text())  # this module's other buckets' too
    figures = lambda b: (b["compiled_ms"], b["eager_ms"])  # noqa: E731
    (slower,) = [k for k, v in verdicts.items() if figures(v) == figures(bucket)]
    (close,) = [k for k, v in verdicts.items() if figures(v) == figures(decoder)]
    verdicts[slower] = {"compiled_ms": 500.0, "eager_ms": 50.0, "at": 1}
    verdicts[close] = {"compiled_ms": 97.0, "eager_ms": 100.0, "at": 1}
    recorded.write_text(json.dumps(verdicts))
    restarted = Pipeline.load(folders["sd15"], devices="cpu", quantize="int8")
    again, said = CompileStats("auto"), []  # the decoder's verdicts as said, and whether ready then

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("compile: decoder") and "ms eager" in record.getMessage():
                said.append((record.getMessage(), again.state))

    logger, handler = logging.getLogger("diffshard"), Said()
    logger.addHandler(handler)
    try:
        caplog.set_level(logging.INFO, logger="diffshard")
        compile_pipeline(restarted, CompileMode.AUTO, [IMAGE_SIZE], 2, cache_dir, again)
    finally:
        logger.removeHandler(handler)
    taken, timed = again.buckets
    assert (*figures(taken), taken["kept"], taken["timed"]) == (500.0, 50.0, False, False), again.buckets
    assert timed["timed"] and figures(timed) != (97.0, 100.0), again.buckets
    (provisional, state), (settled, ready) = said  # the close one taken for now, timed once ready
    assert "compiled for now (97.0 ms compiled, 100.0 ms eager" in provisional and state == "waiting"
    assert ready == "ready" and "97.0 ms" not in settled, said
    assert again.frozen == int(timed["kept"])  # the bucket recorded slower holds no frozen copy
    assert np.abs(_images(restarted, [GUIDED])[0] - eager).max() < TOLERANCE
    assert again.calls["eager"] == steps, again.calls


def test_a_close_verdict_is_settled_once_starts_agree_on_it_and_a_damaged_file_is_timed_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A clear verdict is taken at the next start; a close one (0.95x) once two starts in a row
    timed it the same way, and timed again from one that did not; a verdicts file that is not
    JSON is said and written anew."""
    store = GraphStore(tmp_path, ["cpu"], CompileStats("auto"))
    verdicts = Verdicts(store)
    verdicts.record("clear", {"compiled_ms": 50.0, "eager_ms": 100.0})
    verdicts.record("close", {"compiled_ms": 95.0, "eager_ms": 100.0})
    restarted = Verdicts(store)
    assert restarted.settled("clear") is not None and restarted.settled("close") is None
    restarted.record("close", {"compiled_ms": 96.0, "eager_ms": 100.0})  # faster again: agreed
    assert Verdicts(store).settled("close")["compiled_ms"] == 96.0
    restarted.record("close", {"compiled_ms": 101.0, "eager_ms": 100.0})  # the other way: open again
    assert Verdicts(store).settled("close") is None
    restarted.path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="diffshard"):
        damaged = Verdicts(store)
    assert "are unusable" in caplog.text and damaged.settled("clear") is None
    damaged.record("clear", {"compiled_ms": 50.0, "eager_ms": 100.0})
    assert Verdicts(store).settled("clear") is not None


def test_a_graph_kept_by_another_release_or_diffusers_is_never_loaded(tmp_path: Path, monkeypatch) -> None:
    """Every graph's key (and every verdict's) holds a digest of the engine's and pipeline's
    sources and diffusers' version: a changed family file, or another diffusers, keys apart."""
    server = Path(graphs.__file__).parents[2]
    release = tmp_path / "server"
    for part in graphs.TRACED:
        shutil.copytree(server / part, release / part)
    assert graphs.traced_code(release) == graphs.traced_code()
    family = next((release / "pipeline" / "families").glob("sd*.py"))
    family.write_text(family.read_text() + "\n# fixed since\n")
    assert graphs.traced_code.__wrapped__(release) != graphs.traced_code()
    store = GraphStore(tmp_path / "cache", ["cpu"], CompileStats("auto"))
    graph = {"graph": "denoiser", "inputs": "1x4x8x8"}
    kept = store.key(graph)
    monkeypatch.setattr(graphs.importlib.metadata, "version", lambda name: "0.0.1")
    assert graphs.traced_code.__wrapped__() != graphs.traced_code()
    monkeypatch.setattr(graphs, "traced_code", lambda: "another release")
    assert store.key(graph) != kept


def test_auto_compiles_nothing_without_a_cpp_compiler_or_for_groups_and_says_why(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """inductor builds its CPU kernels with a C++ compiler: where none is on the PATH (a slim
    image), auto serves eagerly and says so instead of failing in the background. A tensor
    group's ranks exchange inside a call: auto leaves them eager too."""
    from server.pipeline.loading.warmup import auto_mode

    pipeline = Pipeline.load(folders["sd15"], devices="cpu")
    assert auto_mode(pipeline)[0] == CompileMode.FULL
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # the venv's bin: python, no g++
    monkeypatch.delenv("CXX", raising=False)
    mode, why = auto_mode(pipeline)
    assert mode == CompileMode.OFF and "install g++" in why
    stats = compile_pipeline(pipeline, CompileMode.AUTO, [IMAGE_SIZE], 2, None)
    assert (stats.mode, stats.state) == ("auto: off", "off") and stats.done.is_set()
    monkeypatch.undo()
    group = Pipeline.load(folders["sd15"], plan=plan_parallel_for(folders["sd15"], "tensor"))
    assert auto_mode(group) == (CompileMode.OFF, "tensor and sequence groups run eagerly")


def test_auto_compiles_each_block_on_a_gpu(folders: dict[str, Path]) -> None:
    """On a GPU a DiT's repeated blocks share one graph (the whole-graph gain is the CPU's frozen
    weights): auto takes blocks on a lone GPU stage, where on the CPU it takes the whole."""
    from server.engine.hardware import simulated
    from server.pipeline.loading.warmup import auto_mode

    with simulated.simulate(1):
        pipeline = Pipeline.load(folders["sd15"], devices="cuda:0")
        assert auto_mode(pipeline)[0] == CompileMode.BLOCKS


def plan_parallel_for(folder: Path, parallel: str):
    from server.pipeline.loading.folder import read_family
    from server.pipeline.loading.model_plan import plan_model

    family = read_family(folder)
    return plan_model(
        family,
        "cpu,cpu",
        "memory",
        dtype=torch.float32,
        batch=2,
        side=IMAGE_SIZE,
        folder=folder,
        parallel=parallel,
    )


def calls_no_bucket_holds_run_eagerly_and_are_counted(pipeline: Pipeline, stats: CompileStats) -> None:
    unguided = GenerationRequest("a blue square", seed=2, steps=3, guidance_scale=1.0)  # one row
    other_size = GenerationRequest("a blue square", seed=2, steps=2, width=IMAGE_SIZE + 16, height=IMAGE_SIZE)
    three = [GUIDED, unguided]  # three rows: more than the largest bucket (2)
    before = dict(stats.calls)
    _images(pipeline, [unguided])  # 1 row, padded to the 2-row bucket
    _images(pipeline, [other_size])  # eager: no bucket of its size
    _images(pipeline, three)  # eager: over the largest bucket
    (state,) = pipeline.start([pipeline.resolve(GUIDED)])  # a bucket's call its plan keeps eager
    with pipeline.pool.scope() as batch, torch.inference_mode():
        inputs = pipeline.stacked([state], batch)
        pipeline.shard.run(inputs, replace(CallPlan.plain(2), compiled=False))  # 1 call
        pipeline.shard.run(inputs, CallPlan.plain(2))  # and as usual: compiled
    state.close()
    calls = {path: stats.calls[path] - before[path] for path in before}
    padded, other, together = (calls_of(pipeline, r) for r in (unguided, other_size, GUIDED))
    assert calls == {"compiled": 1, "padded": padded, "eager": other + together + 1}, calls


def test_a_second_start_loads_from_the_cache_and_a_corrupt_file_compiles_again(
    sd3_folder: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SD3's blocks over two stages (graphs kept on disk: blocks take their module as an argument):
    a second start loads every one, the decoder's frozen graph (its prepacked weights) from its
    package too; a corrupt file or package is compiled again. A start past its time budget builds
    its first bucket and begins no other."""

    def start() -> CompileStats:
        pipeline = Pipeline.load(sd3_folder, devices="cpu,cpu", strategy="even")
        return compile_pipeline(pipeline, CompileMode.BLOCKS, [IMAGE_SIZE], 2, cache_dir)

    first = start()  # the module's cache: the first test compiled these graphs there
    assert first.graphs_ready == first.graphs_total  # SD3's blocks share graphs: fewer were built
    again = start()
    assert (again.loaded, again.compiled, again.frozen) == (first.loaded + first.compiled, 0, 1)
    packages = list((cache_dir / "compiled").glob("*.so"))  # this module's tests' frozen graphs
    assert packages
    budgeted = Pipeline.load(sd3_folder, devices="cpu,cpu", strategy="even")
    eager = _images(budgeted, [GUIDED])[0]
    with caplog.at_level(logging.WARNING, logger="diffshard"):
        stopped = compile_pipeline(budgeted, CompileMode.BLOCKS, [IMAGE_SIZE], 2, cache_dir, budget_s=1e-9)
    # past its budget: the first bucket (the denoiser's) is built all the same, the decoder's never begun
    assert (stopped.state, stopped.graphs_ready, stopped.frozen) == ("stopped", again.graphs_ready - 1, 0)
    assert "compile stopped at its budget (--compile-budget-s 1e-09): 1 of 2 buckets built" in caplog.text
    assert np.abs(_images(budgeted, [GUIDED])[0] - eager).max() < TOLERANCE
    assert stopped.calls["compiled"] > 0
    newest = max((cache_dir / "compiled").glob("*.bin"), key=lambda file: file.stat().st_mtime)
    newest.write_bytes(b"not a graph")  # one file: compiling them all again takes minutes
    for package in packages:  # cut short (a copy onto a full disk, say); a new file: this
        cut = package.with_suffix(".cut")  # process has the whole one open, as a restart would not
        cut.write_bytes(package.read_bytes()[:4096])
        cut.replace(package)
    pipeline = Pipeline.load(sd3_folder, devices="cpu,cpu", strategy="even")
    eager = _images(pipeline, [GUIDED])[0]
    with caplog.at_level(logging.WARNING, logger="diffshard"):
        rebuilt = compile_pipeline(pipeline, CompileMode.BLOCKS, [IMAGE_SIZE], 2, cache_dir)
    assert (rebuilt.loaded, rebuilt.compiled, rebuilt.frozen) == (again.loaded - 2, 2, 1)
    assert "is unusable" in caplog.text and "compiling again" in caplog.text
    assert re.search(r"frozen graph \S+\.so is unusable", caplog.text)
    assert np.abs(_images(pipeline, [GUIDED])[0] - eager).max() < TOLERANCE


def test_full_refuses_a_split(folders: dict[str, Path], cache_dir: Path) -> None:
    pipeline = Pipeline.load(folders["sd15"], devices="cpu,cpu", strategy="even")
    with pytest.raises(ValueError, match="--compile blocks compiles a split"):
        compile_pipeline(pipeline, CompileMode.FULL, [IMAGE_SIZE], 2, cache_dir)


def test_an_unwritable_cache_dir_warns_and_keeps_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache dir should be")
    with caplog.at_level(logging.WARNING, logger="diffshard"):
        store = GraphStore(not_a_folder, torch.device("cpu"), CompileStats("full"))
    assert store.folder is None and store._path("any") is None
    assert "cannot keep compiled graphs" in caplog.text and "compiled again at every start" in caplog.text


def test_auto_takes_the_jit_route_where_this_pytorch_lacks_aot_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2.13 has `aot_compile`; where it is missing (2.11, the lent GPUs': hidden here) `auto` takes
    the just-in-time route, and `aot` asked for stops the start in one line saying what to use."""
    from server.engine.runtime.graphs import CompileRoute, compile_route
    from server.errors import ConfigError
    from server.settings import Settings
    from server.startup import check_compile_route

    assert compile_route("auto") == CompileRoute.AOT
    real = torch.compile

    def without_aot(*args, **kwargs):
        compiled = real(*args, **kwargs)
        del compiled.aot_compile
        return compiled

    monkeypatch.setattr(torch, "compile", without_aot)
    assert compile_route("auto") == CompileRoute.JIT and compile_route("jit") == CompileRoute.JIT
    with pytest.raises(ConfigError, match=r"lacks: use --compile-route jit .*DIFFSHARD_COMPILE_ROUTE"):
        check_compile_route(Settings(compile="blocks", compile_route="aot"))
    check_compile_route(Settings(compile="off", compile_route="aot"))  # nothing compiles: nothing to refuse


def test_the_jit_route_compiles_what_eager_makes_and_a_restart_serves_it_ready_sooner(tmp_path: Path) -> None:
    """The just-in-time route on the built-in model (float32, the 1- and 2-row buckets at 64²): a
    first start (a fresh interpreter) gives eager's images within 1e-3. `serve --compile blocks
    --compile-route jit` with the same --cache-dir then traces again but compiles little
    (inductor's caches and the artifacts the first start kept): /v1/stats says ready sooner than
    the first start took, and a request's calls run compiled."""
    from tests.support.jit_start import first_start
    from tests.support.live import live_server

    cache = tmp_path / "cache"
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        first = fresh.submit(first_start, cache, 1).result(timeout=600)  # 1 thread: the server's lane
    assert (first["state"], first["route"], first["compiled"]) == ("ready", "jit", first["graphs"]["total"])
    assert first["difference"] < TOLERANCE and first["calls"]["compiled"] == first["steps"], first
    assert len(list((cache / "compiled").glob("artifacts-*.bin"))) == 1
    args = (
        "--compile",
        "blocks",
        "--compile-route",
        "jit",
        "--cache-dir",
        str(cache),
        "--dtype",
        "float32",
        "--max-batch",
        "2",
        "--compile-sizes",
        "64",
        "--parallel",
        "off",
        "--threads",
        "1",
    )
    with live_server(*args, fresh=True) as server:  # a restart: a fresh interpreter
        ready = server.wait_for(lambda s: s["compile"]["state"] in ("ready", "failed"), timeout_s=300)
        compiled = ready["compile"]
        assert (compiled["state"], compiled["route"]) == ("ready", "jit"), compiled
        assert compiled["seconds"] < first["seconds"], (compiled["seconds"], first["seconds"])
        figures = {"first_start_s": first["seconds"], "restart_s": compiled["seconds"]}
        print(json.dumps({"jit_route": figures}))  # shown with -s
        body = {"prompt": "a red circle", "size": "64x64", "n": 1}
        answer = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert server.stats()["compile"]["calls"]["compiled"] > 0
