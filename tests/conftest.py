"""Tiny real diffusers UNets built from config under fixed seeds; a live server with API keys;
`python -m server` runs forked from one that imported torch once; `gpu` tests skip without CUDA."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from diffusers import UNet2DConditionModel

from tests.live import MAKE_RUN, LiveServer, free_port, live_server
from tests.tiny_pipelines import BUILDERS, build_flux_folder, build_sd3_folder


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
    CPU that runs it natively and faster (config.py), so servers and settings made in tests take
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
    """Tiny SD-1.5- and SDXL-shaped pipeline folders (tests/tiny_pipelines.py), built once."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build(root / kind) for kind, build in BUILDERS.items()}


def _tiny_builders() -> dict[str, Callable[[Path], Path]]:
    """Every family's tiny folder as published (its scheduler and config), by name; the modules
    import lazily: most runs ask for a few."""
    from tests.tiny_flux2 import build_flux2_folder
    from tests.tiny_pipelines import build_wan_folder
    from tests.tiny_qwenimage import build_qwen_image_folder
    from tests.tiny_wan22 import build_wan22_ti2v_folder, build_wan22_two_expert_folder
    from tests.tiny_zimage import build_zimage_folder

    return {
        "flux-schnell": partial(build_flux_folder, guidance=False),
        "flux2": build_flux2_folder,
        "flux2-klein": partial(build_flux2_folder, variant="klein-base"),
        "qwen-image": build_qwen_image_folder,
        "z-image": build_zimage_folder,
        "wan2.1": build_wan_folder,
        "wan2.2-a14b": build_wan22_two_expert_folder,
        "wan2.2-ti2v": build_wan22_ti2v_folder,
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
def sd3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3-shaped pipeline folder (an MMDiT, two CLIP encoders, no T5), built once."""
    return build_sd3_folder(tmp_path_factory.mktemp("tiny") / "sd3")


@pytest.fixture(scope="session")
def flux_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny FLUX.1-dev-shaped pipeline folder (tests/tiny_pipelines.py), built once."""
    return build_flux_folder(tmp_path_factory.mktemp("tiny") / "flux")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not a keyword: a test id may say gpu
            item.add_marker(skip)


@pytest.fixture(scope="session")
def served() -> Iterator[LiveServer]:
    """The server as `make run` serves it (the built-in model, the diamond adapter) with a metrics
    port, shared by every module that needs nothing else: each start costs seconds of the suite.
    Tests on it read counters as differences, never as totals from zero."""
    with live_server(*MAKE_RUN, "--metrics-port", str(free_port())) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`python -m server serve --api-key-file` with the keys sk-first and sk-second."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# one key a line\nsk-first\nsk-second\n")
    with live_server("--api-key-file", str(keys)) as running:
        yield running


# `python -m MODULE ARGS` forked from a process that imported server.__main__ once (see `forked`)
FORK_SERVER = r"""
import gc, json, os, runpy, socket, sys

listener = socket.socket(fileno=int(sys.argv[1]))
import server.__main__  # for what it imports (torch, diffusers, the app), not for itself: -m
import torch  # runs __main__.py afresh in each child, so it is forgotten here

del sys.modules["server.__main__"], sys.modules["server"].__main__

sys.stdout.flush()
sys.stderr.flush()
forkable = not torch.cuda.is_initialized()  # CUDA cannot be used again in a forked child
gc.freeze()  # the children's collections, and their exits, skip what is shared: no copy of each page


def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def serve():
    while True:
        conn, _ = listener.accept()
        request = json.loads(conn.makefile("rb").readline())
        if "argv" not in request:
            conn.sendall(json.dumps({"forkable": forkable}).encode() + b"\n")
        elif os.fork() == 0:  # a watcher: forks the run, says its pid, then its exit code
            listener.close()
            pid = os.fork()
            if pid == 0:
                conn.close()
                return request
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            status = os.waitpid(pid, 0)[1]
            conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            os._exit(0)
        conn.close()
        reap()


request = serve()  # only a forked run gets here: it runs as `python -m MODULE ARGS` would
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, fd)
    os.close(out)
sys.argv = request["argv"]  # [MODULE, ARGS...]: run_module makes the first its file, as -m does
del request, listener
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)  # uncaught: a traceback, exit 1
"""


class Forked:
    """`python -m MODULE ARGS` as a process of its own (its exit code, stdout and stderr, the
    interpreter's own exit and traceback), forked from one that already imported what `python -m
    server` imports: torch, diffusers and the app cost seconds a start, paid here once. What that
    import printed starts every run's output, as it would a fresh interpreter's; `import_s` is its
    time, to add where a test times a start. Without fork (CUDA already initialised), a plain
    subprocess."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.names = itertools.count()
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(folder / "fork.sock"))
        self.listener.listen(64)
        started = time.monotonic()
        with (folder / "import.out").open("w") as out, (folder / "import.err").open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-c", FORK_SERVER, str(self.listener.fileno())],
                pass_fds=[self.listener.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=os.environ | {"HF_HUB_OFFLINE": "1"},
            )
        self.listener.close()  # the fork server's now: if it dies, connecting to it fails at once
        try:
            with self._ask({}, timeout_s=120) as answers:  # answered once the imports are done
                answer = answers.readline()
        except ConnectionError:
            answer = b""
        if not answer:
            self.process.wait(timeout=30)
            raise RuntimeError(f"the fork server died importing: {(folder / 'import.err').read_text()}")
        self.forkable: bool = json.loads(answer)["forkable"]
        self.import_s = time.monotonic() - started
        self.preamble = [(folder / f"import.{stream}").read_text() for stream in ("out", "err")]

    def _ask(self, request: dict, timeout_s: float) -> BinaryIO:
        """The fork server's answers to `request`, a line each."""
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(timeout_s)
            conn.connect(str(self.folder / "fork.sock"))
            conn.sendall(json.dumps(request).encode() + b"\n")
            return conn.makefile("rb")  # keeps the connection open until it closes

    def run(
        self, module: str, *args: str, timeout_s: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """As `subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
        text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"} | env, timeout=timeout_s)`."""
        env = os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {})
        command = [sys.executable, "-m", module, *args]
        if not self.forkable:
            return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        name = next(self.names)
        paths = [self.folder / f"{name}.{stream}" for stream in ("out", "err")]
        request = {"argv": [module, *args], "env": env, "cwd": os.getcwd()}
        with self._ask(request | {"stdout": str(paths[0]), "stderr": str(paths[1])}, timeout_s) as answers:
            pid = json.loads(answers.readline())["pid"]
            try:
                code = json.loads(answers.readline())["code"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout_s) from None
        out, err = (before + path.read_text() for before, path in zip(self.preamble, paths, strict=True))
        for path in paths:
            path.unlink()
        return subprocess.CompletedProcess(command, code, out, err)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="session")
def forked(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[Forked]:
    """`python -m server ...` runs (and other `python -m` modules) without importing torch each time."""
    running = Forked(tmp_path_factory.mktemp("forked"))
    yield running
    running.close()


Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_cli(forked: Forked) -> Cli:
    """`python -m server ARGS` in a process of its own: exit code, stdout, stderr."""
    return partial(forked.run, "server")
