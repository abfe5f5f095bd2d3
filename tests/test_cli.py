"""`python -m server plan` and `serve`: the JSON plan, and failures that end with one line saying
what to fix, each run a process of its own (forked from one that imported torch, diffusers and
the app once: conftest's Forked), and one plan in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from server.__main__ import main
from server.demo import MODEL_DIR
from tests.conftest import Cli
from tests.support.live import free_port


def test_plan_sd15_memory_json(run_cli: Cli) -> None:
    done = run_cli(
        "plan",
        "--config",
        "sd15",
        "--devices",
        "cpu,cpu,cpu",
        "--parallel",
        "off",  # a layer split, as on GPUs that cannot hold the model alone
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


def test_plan_table_for_sdxl(run_cli: Cli) -> None:
    done = run_cli("plan", "--config", "sdxl", "--devices", "cpu,cpu", "--resolution", "512")
    assert done.returncode == 0, done.stderr
    assert "latent=64x64" in done.stdout and "add_embedding" not in done.stdout  # blocks, not modules


def test_errors_are_one_line_with_exit_code_2(run_cli: Cli) -> None:
    if torch.cuda.device_count() <= 3:  # serving needs the devices; planning may name absent ones
        done = run_cli("serve", "--devices", "cuda:3")
        assert done.returncode == 2
        assert done.stderr.startswith("error: --devices (DIFFSHARD_DEVICES): unknown device 'cuda:3'")
        done = run_cli("plan", "--config", "sd15", "--devices", "cuda:3")
        assert done.returncode == 2 and "cuda:3 is not on this host: give its budget" in done.stderr
    done = run_cli(
        "plan", "--config", "sd15", "--devices", "cpu", "--strategy", "memory", "--max-memory", "cpu=1GiB"
    )
    assert done.returncode == 2 and "short" in done.stderr


def test_model_folder_that_is_not_a_pipeline(run_cli: Cli, tmp_path) -> None:
    done = run_cli("plan", "--model", str(tmp_path))
    assert (
        done.returncode == 2
        and "--model (DIFFSHARD_MODEL)" in done.stderr
        and "model_index.json" in done.stderr
    )


def test_plan_and_serve_share_their_defaults(run_cli: Cli) -> None:
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


def test_plan_for_absent_gpus_predicts_every_candidate_from_a_device_profile(capsys) -> None:
    """Two GPUs this host lacks, a budget each: replicas are weighed (each replica under its own
    GPU's budget), every candidate is predicted from the chosen profile, which the output names,
    and auto's dtype is the profile's. In-process: a subprocess would cost seconds of imports."""
    devices, budgets = "cuda:14,cuda:15", "cuda:14=24GiB,cuda:15=24GiB"
    args = ["plan", "--config", "sd15", "--devices", devices, "--max-memory", budgets, "--json"]
    args += ["--dtype", "auto"]  # the tests' default is float32 (conftest.py)
    assert main([*args, "--device-profile", "L4"]) == 0
    plan = json.loads(capsys.readouterr().out)
    parallel = plan["parallel"]
    assert parallel["kind"] == "replicas" and plan["dtype"] == "bfloat16"
    assert "predicted from the l4 profile, NVIDIA L4's published peaks" in parallel["costs"]
    # two replicas, a pipeline of two stages, and one device (the baseline)
    assert {(c["replicas"], c["stages"]) for c in parallel["candidates"]} == {(2, 1), (1, 2), (1, 1)}
    assert all(c["predicted_rows_per_s"] and c["predicted_lone_step_s"] for c in parallel["candidates"])
    assert main([*args, "--device-profile", "nope"]) == 2
    assert (
        "--device-profile (DIFFSHARD_DEVICE_PROFILE): unknown device profile 'nope'"
        in capsys.readouterr().err
    )


def test_plan_for_one_absent_gpu_listed_twice_names_its_workers_apart(capsys) -> None:
    """`--devices cuda:14,cuda:14` (a one-GPU host's check of the replica path): the workers are
    cuda:14#0 and cuda:14#1, and both replicas sit within the one budget: each half of what the
    encoders and VAE leave, the first with them."""
    args = ["plan", "--config", "sd15", "--devices", "cuda:14,cuda:14", "--max-memory", "cuda:14=24GiB"]
    assert main([*args, "--parallel", "replicas", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parallel"]["workers"] == ["cuda:14#0", "cuda:14#1"]
    assert plan["parallel"]["replica_devices"] == [["cuda:14"], ["cuda:14"]]
    (first,) = plan["devices"]  # the first replica's
    assert first["budget"] == (24 * 2**30 - first["other_bytes"]) // 2 + first["other_bytes"]


def test_every_option_has_help_and_help_prints(run_cli: Cli) -> None:
    for command in ("serve", "plan"):
        done = run_cli(command, "-h")
        assert done.returncode == 0, done.stderr
        assert "DIFFSHARD_DEVICES" in done.stdout and "default: auto" in done.stdout


def damaged_copy(tmp_path: Path) -> Path:
    """The built-in model with its UNet weights cut short."""
    folder = tmp_path / "model"
    shutil.copytree(MODEL_DIR, folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    with weights.open("r+b") as file:
        file.truncate(weights.stat().st_size - 1000)
    return folder


def test_fault_injection_off_loopback_is_refused_in_one_line(run_cli: Cli) -> None:
    """Busy ports, damaged folders and the other bad startups: tests/reliability/test_bad_startup.py."""
    done = run_cli("serve", "--host", "0.0.0.0", "--inject-faults")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --inject-faults (DIFFSHARD_INJECT_FAULTS)") and "loopback" in last
    assert "Traceback" not in done.stderr and "ready:" not in done.stderr


def test_debug_adds_the_traceback_before_the_line(run_cli: Cli, tmp_path: Path) -> None:
    done = run_cli("serve", "--model", str(damaged_copy(tmp_path)), "--debug")
    assert done.returncode == 2 and "Traceback (most recent call last)" in done.stderr
    assert "corrupt or truncated" in done.stderr.strip().splitlines()[-1]


def test_a_load_that_fails_after_validation_also_ends_with_one_line(run_cli: Cli, tmp_path: Path) -> None:
    """Headers fine, tensors wrong: only loading finds it, after the port listens; the server
    stops (exit 1) and its last line still names the folder and the cause."""
    folder = tmp_path / "model"
    shutil.copytree(MODEL_DIR, folder)
    save_file({"x": torch.zeros(4)}, folder / "vae" / "diffusion_pytorch_model.safetensors")
    done = run_cli("serve", "--model", str(folder), "--port", str(free_port()), "--metrics-port", "0")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: cannot serve {folder}: ")
    assert "Traceback" not in done.stderr and "ready:" not in done.stderr


def test_compile_and_step_budget_settings_say_what_to_fix(run_cli: Cli) -> None:
    done = run_cli("serve", "--compile", "fast")
    assert done.returncode == 2 and "error: --compile (DIFFSHARD_COMPILE)" in done.stderr
    assert "'off', 'blocks', 'full' or 'auto'" in done.stderr
    done = run_cli("serve", "--compile-sizes", "64,60")
    assert done.returncode == 2 and "multiples of 8, got [64, 60]" in done.stderr
    done = run_cli("serve", "--step-budget", "0")
    assert done.returncode == 2 and "error: --step-budget (DIFFSHARD_STEP_BUDGET)" in done.stderr
    port = str(free_port())  # validated, then refused at load: full cannot compile a split
    done = run_cli(
        "serve",
        "--port",
        port,
        "--metrics-port",
        "0",
        "--devices",
        "cpu,cpu",
        "--parallel",
        "pipeline",
        "--compile",
        "full",
    )
    assert done.returncode != 0 and "--compile full needs a plan of one stage" in done.stderr


def test_quantize_errors_name_the_setting_the_device_and_what_to_write(run_cli: Cli, tmp_path) -> None:
    done = run_cli("serve", "--devices", "cpu", "--quantize", "int4")
    assert done.returncode == 2
    assert done.stderr.startswith(
        "error: --quantize (DIFFSHARD_QUANTIZE): write a mode (off, int8, int8-dynamic"
    )
    done = run_cli("serve", "--devices", "cpu", "--quantize", "float8")
    assert done.returncode == 2
    assert done.stderr.startswith("error: --quantize (DIFFSHARD_QUANTIZE): float8 needs a CUDA GPU; cpu runs")
    done = run_cli("serve", "--devices", "cpu", "--quantize", "text_encoder_9=int8")
    assert done.returncode == 2 and "name one of denoiser, text_encoder" in done.stderr
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"GGUF but not really")
    done = run_cli("serve", "--devices", "cpu", "--denoiser-file", str(not_gguf))
    assert done.returncode == 2 and "is not a readable GGUF file" in done.stderr
    done = run_cli("serve", "--devices", "cpu", "--denoiser-file", str(tmp_path / "missing.safetensors"))
    assert done.returncode == 2 and "is not a .gguf file" in done.stderr
    assert "Traceback" not in done.stderr
