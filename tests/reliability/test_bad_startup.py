"""Startup with bad models and bad settings: each `python -m server serve` must exit non-zero
within seconds, never say "ready", print no traceback (that takes --debug), and end its output
with one line that says what to fix. Each case is a process of its own, forked from one that
imported torch, diffusers and the app once (conftest's Forked); its seconds count that import
too. Run with `-s` to see the table of cases (exit code, seconds, last line), also printed as one
JSON line."""

from __future__ import annotations

import json
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.forking import Forked
from tests.support.live import free_port

MODEL_DIR = Path(__file__).parents[2] / "server" / "demo" / "model"  # the built-in model
WITHIN_S = 30  # "within seconds": importing torch and diffusers alone takes a few here
UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"
# what `serve` shards over with its default `--devices auto`: every visible CUDA device, else cpu
VISIBLE = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]


@dataclass
class Case:
    name: str
    args: Callable[[Path, socket.socket], list[str]]  # (tmp folder, a busy listening socket) → flags
    words: Callable[[Path, socket.socket], list[str]]  # what the last line must say


def copy_model(tmp: Path) -> Path:
    folder = tmp / "model"
    if not folder.exists():
        shutil.copytree(MODEL_DIR, folder)
    return folder


def truncated(tmp: Path) -> Path:
    folder = copy_model(tmp)
    weights = folder / UNET_WEIGHTS
    with weights.open("r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    return folder


def naming(unet: list[str]) -> Callable[[Path], Path]:
    def folder_naming(tmp: Path) -> Path:
        folder = copy_model(tmp)
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**index, "unet": unet}))
        return folder

    return folder_naming


def pickle_only(tmp: Path) -> Path:
    folder = copy_model(tmp)
    (folder / UNET_WEIGHTS).rename(folder / "unet" / "diffusion_pytorch_model.bin")
    return folder


def empty(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def empty_key_file(tmp: Path) -> Path:
    keys = tmp / "keys.txt"
    keys.write_text("# no keys yet\n\n")
    return keys


def misfit_lora(tmp: Path) -> Path:
    """A LoRA for a layer the built-in model has, of the wrong width."""
    path = tmp / "misfit.safetensors"
    module = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    save_file(
        {f"{module}.lora_A.weight": torch.zeros(4, 7), f"{module}.lora_B.weight": torch.zeros(7, 4)}, path
    )
    return path


def port_of(busy: socket.socket) -> str:
    return str(busy.getsockname()[1])


CASES = [
    Case(
        "missing folder",
        lambda t, b: ["--model", str(t / "nowhere")],
        lambda t, b: [str(t / "nowhere"), "model_index.json"],
    ),
    Case(
        "empty folder",
        lambda t, b: ["--model", str(empty(t))],
        lambda t, b: [str(t / "empty"), "model_index.json"],
    ),
    Case(
        "truncated safetensors",
        lambda t, b: ["--model", str(truncated(t))],
        lambda t, b: ["diffusion_pytorch_model.safetensors", "truncated"],
    ),
    Case(
        "unknown class",
        lambda t, b: ["--model", str(naming(["diffusers", "NoSuchModel"])(t))],
        lambda t, b: ["NoSuchModel", "unet"],
    ),
    Case(
        "class from another library",
        lambda t, b: ["--model", str(naming(["os", "system"])(t))],
        lambda t, b: ["os.system", "diffusers", "transformers"],
    ),
    Case(
        "pickle-only weights",
        lambda t, b: ["--model", str(pickle_only(t))],
        lambda t, b: ["diffusion_pytorch_model.bin", "pickle", "safetensors"],
    ),
    Case(
        "device that does not exist",
        lambda t, b: ["--devices", "cuda:7"],
        lambda t, b: ["--devices", "cuda:7"],
    ),
    Case(
        "budget too small",
        lambda t, b: ["--max-memory", ",".join(f"{device}=1MiB" for device in VISIBLE)],
        lambda t, b: [VISIBLE[0], "short"],
    ),
    Case(
        "empty API-key file",
        lambda t, b: ["--api-key-file", str(empty_key_file(t))],
        lambda t, b: ["--api-key-file", "holds no keys"],
    ),
    Case(
        "adapter that is not safetensors",
        lambda t, b: ["--lora", f"style={t / 'style.bin'}"],
        lambda t, b: ["--lora", "style.bin", "safetensors"],
    ),
    Case(
        "adapter that does not fit",
        lambda t, b: ["--lora", f"misfit={misfit_lora(t)}"],
        lambda t, b: ["misfit.safetensors", "does not fit", "attn1.to_q"],
    ),
    Case(
        "attention backend named without a CUDA device",
        lambda t, b: ["--devices", "cpu", "--attention", "cudnn"],
        lambda t, b: ["--attention cudnn", "no CUDA device", "auto or default"],
    ),
    Case("busy API port", lambda t, b: ["--port", port_of(b)], lambda t, b: ["--port", port_of(b), "in use"]),
    Case(
        "busy metrics port",
        lambda t, b: ["--metrics-port", port_of(b)],
        lambda t, b: ["--metrics-port", port_of(b), "in use"],
    ),
]
PARALLEL = 2  # cases started at once: one per core here, so each still takes about its own time


@dataclass
class Outcome:
    exit_code: int
    seconds: float
    stderr: str
    words: list[str]

    @property
    def last_line(self) -> str:
        return (self.stderr.strip().splitlines() or [""])[-1]


def start(case: Case, tmp: Path, busy: socket.socket, forked: Forked) -> Outcome:
    """`python -m server serve` with the case's flags; its seconds: the run's, plus the import's."""
    args = case.args(tmp, busy)
    if "--port" not in args:
        args += ["--port", str(free_port())]
    if "--metrics-port" not in args:
        args += ["--metrics-port", "0"]
    started = time.monotonic()
    result = forked.run("server", "serve", "--host", "127.0.0.1", *args, timeout_s=120)
    seconds = forked.import_s + time.monotonic() - started
    return Outcome(result.returncode, seconds, result.stderr, case.words(tmp, busy))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, forked: Forked) -> Iterator[dict[str, Outcome]]:
    """Every case run once, PARALLEL at a time, while a socket holds a port; then the table."""
    with socket.socket() as busy, ThreadPoolExecutor(PARALLEL) as pool:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        folders = {case.name: tmp_path_factory.mktemp(case.name.replace(" ", "-")) for case in CASES}
        futures = {case.name: pool.submit(start, case, folders[case.name], busy, forked) for case in CASES}
        done = {name: future.result() for name, future in futures.items()}
    table = [
        {"case": name, "exit_code": o.exit_code, "seconds": round(o.seconds, 1), "last_line": o.last_line}
        for name, o in done.items()
    ]
    print("\nbad startup: case | exit code | seconds | last line")
    for row in table:
        print(f"  {row['case']} | {row['exit_code']} | {row['seconds']} | {row['last_line']}")
    print(json.dumps({"bad_startup": table}))
    yield done


@pytest.mark.parametrize("case", CASES, ids=[case.name.replace(" ", "-") for case in CASES])
def test_a_bad_model_or_setting_exits_at_once_with_one_line_saying_what_to_fix(
    case: Case, outcomes: dict[str, Outcome]
) -> None:
    outcome = outcomes[case.name]
    assert outcome.exit_code != 0, outcome.stderr
    assert outcome.seconds < WITHIN_S
    assert "diffshard: ready" not in outcome.stderr
    assert "Traceback" not in outcome.stderr, outcome.stderr
    for word in outcome.words:
        assert word in outcome.last_line, f"{word!r} not in the last line; stderr:\n{outcome.stderr}"
