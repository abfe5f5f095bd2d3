"""`python -m server plan` and `serve`: the JSON plan, and failures that end with one line saying
what to fix, through a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from server.demo import MODEL_DIR
from tests.live import free_port


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "server", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_plan_sd15_memory_json() -> None:
    done = run_cli(
        "plan",
        "--config",
        "sd15",
        "--devices",
        "cpu,cpu,cpu",
        "--strategy",
        "memory",
        "--dtype",
        "bfloat16",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["strategy"] == "memory" and plan["dtype"] == "bfloat16"
    assert [s["device"] for s in plan["stages"]] == ["cpu"] * 3
    blocks = [b for s in plan["stages"] for b in s["blocks"]]
    assert blocks.index("mid_block") < blocks.index("up_blocks.0")
    assert len(blocks) == 12
    assert [b["after_stage"] for b in plan["boundaries"]] == [0, 1]
    assert all(b["bytes"] > 0 for b in plan["boundaries"])
    # SD-1.5's UNet is 859.5 M parameters: 1.72 GB in bfloat16
    assert sum(s["param_bytes"] for s in plan["stages"]) == 2 * 859_520_964


def test_plan_table_for_sdxl() -> None:
    done = run_cli("plan", "--config", "sdxl", "--devices", "cpu,cpu", "--resolution", "512")
    assert done.returncode == 0, done.stderr
    assert "latent=64x64" in done.stdout and "add_embedding" not in done.stdout  # blocks, not modules


def test_errors_are_one_line_with_exit_code_2() -> None:
    done = run_cli("plan", "--config", "sd15", "--devices", "cuda:3")
    assert done.returncode == 2
    assert done.stderr.startswith("error: --devices (DIFFSHARD_DEVICES): unknown device 'cuda:3'")
    done = run_cli(
        "plan", "--config", "sd15", "--devices", "cpu", "--strategy", "memory", "--max-memory", "cpu=1GiB"
    )
    assert done.returncode == 2 and "short" in done.stderr


def test_model_folder_that_is_not_a_pipeline(tmp_path) -> None:
    done = run_cli("plan", "--model", str(tmp_path))
    assert (
        done.returncode == 2
        and "--model (DIFFSHARD_MODEL)" in done.stderr
        and "model_index.json" in done.stderr
    )


def test_plan_and_serve_share_their_defaults() -> None:
    """With no options, `plan` prints the plan `serve` runs: the built-in model, every GPU else
    the CPU, the memory strategy, the dtype for those devices, reserve for --max-batch rows."""
    done = run_cli("plan", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    gpu = torch.cuda.is_available()
    assert plan["strategy"] == "memory" and plan["batch"] == 16
    assert plan["stages"][0]["device"] == ("cuda:0" if gpu else "cpu")
    assert gpu or plan["dtype"] == "float32"
    # the largest allowed side: max_pixels defaults to 4x the native 64x64, so 128, through the 4x VAE
    assert plan["latent_size"] == 128 // 4
    assert plan["devices"][0]["other_bytes"] > 0  # the text encoder and VAE share the first device


def test_every_option_has_help_and_help_prints() -> None:
    for command in ("serve", "plan"):
        done = run_cli(command, "-h")
        assert done.returncode == 0, done.stderr
        assert "DIFFSHARD_DEVICES" in done.stdout and "default: auto" in done.stdout


def listening_port() -> socket.socket:
    """A loopback port something already listens on."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def damaged_copy(tmp_path: Path, damage: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(MODEL_DIR, folder)
    if damage == "truncated":
        weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
        with weights.open("r+b") as file:
            file.truncate(weights.stat().st_size - 1000)
    else:
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps(index | {"unet": ["diffusers", "NoSuchUNet"]}))
    return folder


def startup_case(case: str, busy: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """(serve's arguments, words its last line must hold) for one bad startup."""
    if case == "api port busy":
        return ["--port", busy, "--metrics-port", "0"], ["--port (DIFFSHARD_PORT)", busy, "in use"]
    if case == "metrics port busy":
        words = ["--metrics-port (DIFFSHARD_METRICS_PORT)", busy, "in use"]
        return ["--port", str(free_port()), "--metrics-port", busy], words
    if case == "truncated weights":
        folder = damaged_copy(tmp_path, "truncated")
        return ["--model", str(folder)], ["diffusion_pytorch_model.safetensors is corrupt or truncated"]
    if case == "unknown class":
        folder = damaged_copy(tmp_path, "class")
        return ["--model", str(folder)], ["diffusers.NoSuchUNet for unet", "not a class"]
    assert case == "faults not on loopback"
    return ["--host", "0.0.0.0", "--inject-faults"], ["--inject-faults (DIFFSHARD_INJECT_FAULTS)", "loopback"]


@pytest.mark.parametrize(
    "case",
    ["api port busy", "metrics port busy", "truncated weights", "unknown class", "faults not on loopback"],
)
def test_startup_failures_end_with_one_line_naming_the_cause(case: str, tmp_path: Path) -> None:
    """Each fails before any weight loads or any port listens: exit 2, no traceback, no "ready",
    and the last line says what to fix."""
    with listening_port() as holder:
        args, words = startup_case(case, str(holder.getsockname()[1]), tmp_path)
        started = time.monotonic()
        done = run_cli("serve", *args)
        seconds = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), done.stderr
    for word in words:
        assert word in last
    assert "Traceback" not in done.stderr and "ready:" not in done.stderr
    assert seconds < 60  # seconds here (most of it importing torch), not a model load


def test_debug_adds_the_traceback_before_the_line(tmp_path: Path) -> None:
    done = run_cli("serve", "--model", str(damaged_copy(tmp_path, "truncated")), "--debug")
    assert done.returncode == 2 and "Traceback (most recent call last)" in done.stderr
    assert "corrupt or truncated" in done.stderr.strip().splitlines()[-1]


def test_a_load_that_fails_after_validation_also_ends_with_one_line(tmp_path: Path) -> None:
    """Headers fine, tensors wrong: only loading finds it, after the port listens; the server
    stops (exit 1) and its last line still names the folder and the cause."""
    folder = tmp_path / "model"
    shutil.copytree(MODEL_DIR, folder)
    save_file({"x": torch.zeros(4)}, folder / "vae" / "diffusion_pytorch_model.safetensors")
    done = run_cli("serve", "--model", str(folder), "--port", str(free_port()), "--metrics-port", "0")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: cannot serve {folder}: ")
    assert "Traceback" not in done.stderr and "ready:" not in done.stderr
