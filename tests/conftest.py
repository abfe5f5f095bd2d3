"""Tiny real diffusers UNets built from config under fixed seeds; a live server with API keys;
`python -m server` runs forked from one that imported torch once; `gpu` tests skip without CUDA."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from tests.support import live
from tests.support.forking import Forked
from tests.support.live import MAKE_RUN, LiveServer, free_port, live_server
from tests.support.tiny_pipelines import (
    BUILDERS,
    build_flux_folder,
    build_flux_kontext_folder,
    build_sd3_folder,
)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker takes its own share of the
    host's CPUs, and the servers it starts inherit them: two torch thread pools spinning on the
    same cores would slow each call several times over (measured: the demo's scoring 14 s alone,
    70 s beside another unpinned)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[int(worker.removeprefix("gw")) % len(cpus) :: int(count)] or cpus
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


def tiny_sd15_unet() -> UNet2DConditionModel:
    """SD-1.5-shaped: cross-attention down/up blocks around a plain pair, 3 levels."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        block_out_channels=(32, 32, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=2,
        cross_attention_dim=32,
        attention_head_dim=8,
    ).eval()


def tiny_sdxl_unet() -> UNet2DConditionModel:
    """SDXL-shaped: text_time added embeddings, linear projections, 2 transformer layers deep."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        layers_per_block=2,
        transformer_layers_per_block=(1, 2),
        cross_attention_dim=32,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,
    ).eval()


TINY_UNETS = {"sd15": tiny_sd15_unet, "sdxl": tiny_sdxl_unet}


@pytest.fixture(params=sorted(TINY_UNETS))
def tiny_unet(request: pytest.FixtureRequest) -> UNet2DConditionModel:
    return TINY_UNETS[request.param]()


@pytest.fixture(scope="session", autouse=True)
def cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The planner's calibrations go to a folder of this session (servers started by tests
    inherit it), not to the user's ~/.cache: calibrated once a session, then reused."""
    folder = tmp_path_factory.mktemp("diffshard-cache")
    with pytest.MonkeyPatch.context() as env:  # set for the session, restored after it
        env.setenv("DIFFSHARD_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="session", autouse=True)
def data_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The default job store (`$XDG_DATA_HOME/diffshard/jobs.sqlite`) in a folder of this session,
    not the user's: servers started by tests inherit it."""
    folder = tmp_path_factory.mktemp("data-home")
    with pytest.MonkeyPatch.context() as env:  # set for the session, restored after it
        env.setenv("XDG_DATA_HOME", str(folder))
        yield folder


@pytest.fixture(scope="session", autouse=True)
def float32_by_default() -> Iterator[None]:
    """Tests compare images with diffusers' float32 ones: `--dtype auto` would pick bfloat16 on a
    CPU that runs it natively and faster (startup.py), so servers and settings made in tests take
    float32 unless a test asks for another dtype (tests/test_quantize.py tests auto itself)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DIFFSHARD_DTYPE", "float32")
        yield


@pytest.fixture(scope="session", autouse=True)
def eager_by_default() -> Iterator[None]:
    """Servers made in tests run eagerly: `--compile auto` (the default) would compile every one's
    graphs in the background, minutes of the CI's two cores each. Compiling, auto included, is
    tested in tests/test_compile.py."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DIFFSHARD_COMPILE", "off")
        yield


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SD-1.5- and SDXL-shaped pipeline folders (tests/support/tiny_pipelines.py), built once."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build(root / kind) for kind, build in BUILDERS.items()}


def _tiny_builders() -> dict[str, Callable[[Path], Path]]:
    """Every family's tiny folder as published (its scheduler and config), by name; the modules
    import lazily: most runs ask for a few."""
    from tests.support.tiny_flux2 import build_flux2_folder
    from tests.support.tiny_flux3 import build_flux3_folder
    from tests.support.tiny_hunyuan15 import build_hunyuan15_folder, build_hunyuan15_i2v_folder
    from tests.support.tiny_ltx2 import build_ltx2_folder
    from tests.support.tiny_pipelines import build_wan_folder, build_wan_i2v_folder
    from tests.support.tiny_qwen21 import build_qwen21_folder
    from tests.support.tiny_qwenimage import build_qwen_image_folder
    from tests.support.tiny_wan22 import (
        build_wan22_i2v_two_expert_folder,
        build_wan22_ti2v_folder,
        build_wan22_two_expert_folder,
    )
    from tests.support.tiny_zimage import build_zimage_folder

    return {
        "sd3": build_sd3_folder,
        "flux": build_flux_folder,
        "flux-schnell": partial(build_flux_folder, guidance=False),
        "flux-kontext": build_flux_kontext_folder,
        "flux2": build_flux2_folder,
        "flux2-klein": partial(build_flux2_folder, variant="klein-base"),
        "flux3": build_flux3_folder,
        "flux3-distilled": partial(build_flux3_folder, variant="distilled"),
        "qwen-image": build_qwen_image_folder,
        "qwen-image-2.1": build_qwen21_folder,
        "qwen-image-2.1-turbo": partial(build_qwen21_folder, variant="turbo"),
        "z-image": build_zimage_folder,
        "wan2.1": build_wan_folder,
        "wan2.1-i2v": build_wan_i2v_folder,
        "wan2.2-a14b": build_wan22_two_expert_folder,
        "wan2.2-i2v-a14b": build_wan22_i2v_two_expert_folder,
        "wan2.2-ti2v": build_wan22_ti2v_folder,
        "hunyuanvideo-1.5": build_hunyuan15_folder,
        "hunyuanvideo-1.5-i2v": build_hunyuan15_i2v_folder,
        "ltx-2": build_ltx2_folder,
        "ltx-2.3": partial(build_ltx2_folder, version="2.3"),
    }


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A family's tiny folder by name (`_tiny_builders`), built the first time any module asks:
    the modules that hold a family to its pipeline share one folder."""
    root, built = tmp_path_factory.mktemp("tiny-families"), {}

    def folder(name: str) -> Path:
        if name not in built:
            built[name] = _tiny_builders()[name](root / name)
        return built[name]

    return folder


@pytest.fixture(scope="session")
def sd3_folder(tiny_folder: Callable[[str], Path]) -> Path:
    """A tiny SD3-shaped pipeline folder (an MMDiT, two CLIP encoders, no T5), built once."""
    return tiny_folder("sd3")


@pytest.fixture(scope="session")
def flux_folder(tiny_folder: Callable[[str], Path]) -> Path:
    """A tiny FLUX.1-dev-shaped pipeline folder (tests/support/tiny_pipelines.py), built once."""
    return tiny_folder("flux")


# The tiers a developer deselects while working (`pytest -m "not (live or browser or fuzz or compile)"`);
# `make test` runs them all. By module: what its tests start or build.
BROWSER_MODULES = (
    "test_playground.py",
    "test_playground_edit.py",
    "test_playground_control.py",
    "test_playground_video.py",
)
FUZZ_MODULES = ("test_openapi_fuzz.py",)
COMPILE_MODULES = (
    "test_compile.py",
    "test_gpu_check.py",
    "test_tracing.py",
    "test_attention.py",
    "test_packages.py",
)
TIERS = {"browser": BROWSER_MODULES, "fuzz": FUZZ_MODULES, "compile": COMPILE_MODULES}
LIVE_FIXTURES = {"served", "keyed_server", "fuzzed"}  # session and module servers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    starts_servers: dict[Path, bool] = {}
    for item in items:
        path = Path(item.fspath)
        if path not in starts_servers:
            starts_servers[path] = "live_server(" in path.read_text()
        if starts_servers[path] or LIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)
        for marker, names in TIERS.items():
            if path.name in names:
                item.add_marker(getattr(pytest.mark, marker))
    heaviest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not a keyword: a test id may say gpu
            item.add_marker(skip)


# A module's likely weight by its tier: what compiles takes minutes, what starts servers or a
# browser tens of seconds, the rest seconds. `make test` hands modules to its workers in this
# order (`--no-loadscope-reorder`; xdist's own order is by test count, which put the GPU check's
# dry run, 3 tests and 2.5 minutes, last, its worker running alone at the end).
WEIGHT_BY_TIER = ("compile", "fuzz", "browser", "live")


def heaviest_first(items: list[pytest.Item]) -> None:
    """Modules ordered by tier (WEIGHT_BY_TIER), then by their tests' count, each kept whole."""
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(Path(item.fspath), []).append(item)

    def weight(tests: list[pytest.Item]) -> tuple[int, int]:
        tiers = [i for i, tier in enumerate(WEIGHT_BY_TIER) if tests[0].get_closest_marker(tier)]
        return (min(tiers, default=len(WEIGHT_BY_TIER)), -len(tests))

    items[:] = [item for tests in sorted(modules.values(), key=weight) for item in tests]


@pytest.fixture(scope="session")
def served() -> Iterator[LiveServer]:
    """The server as `make run` serves it (the built-in model, the diamond adapter) with a metrics
    port, shared by every module that needs nothing else: each start costs seconds of the suite.
    Tests on it read counters as differences, never as totals from zero."""
    with live_server(*MAKE_RUN, "--metrics-port", str(free_port())) as running:
        yield running


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One headless Chromium for the session's playground tests (`tests/support/browser.py`)."""
    from tests.support.browser import chromium

    with chromium(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver


@pytest.fixture(scope="module")
def server(served: LiveServer) -> LiveServer:
    """The built-in model as `make run` serves it, where a module starts no server of its own."""
    return served


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`python -m server serve --api-key-file` with the keys sk-first and sk-second, for the
    session: the modules that use it only send requests and read answers."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# one key a line\nsk-first\nsk-second\n")
    with live_server("--api-key-file", str(keys)) as running:
        yield running


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[Callable[[], Forked]]:
    """The session's fork server (`tests/support/forking.py`), started the first time a run or a live
    server (`live.py`) asks: each then skips importing torch, diffusers and the app."""
    started: list[Forked] = []
    lock = threading.Lock()

    def start() -> Forked:
        with lock:
            if not started:
                started.append(Forked(tmp_path_factory.mktemp("forked")))
            return started[0]

    live.forking = start
    yield start
    live.forking = None
    for running in started:
        running.close()


@pytest.fixture(scope="session")
def forked(fork_server: Callable[[], Forked]) -> Forked:
    """`python -m server ...` runs (and other `python -m` modules) without importing torch each time."""
    return fork_server()


Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_cli(forked: Forked) -> Cli:
    """`python -m server ARGS` in a process of its own: exit code, stdout, stderr."""
    return partial(forked.run, "server")
