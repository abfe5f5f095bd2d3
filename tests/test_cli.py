"""`python -m server plan`: the JSON plan and the errors, through a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


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
    assert plan["latent_size"] == 1024 // 4  # the largest allowed side (1024²) through the 4x VAE
    assert plan["devices"][0]["other_bytes"] > 0  # the text encoder and VAE share the first device


def test_every_option_has_help_and_help_prints() -> None:
    for command in ("serve", "plan"):
        done = run_cli(command, "-h")
        assert done.returncode == 0, done.stderr
        assert "DIFFSHARD_DEVICES" in done.stdout and "default: auto" in done.stdout
