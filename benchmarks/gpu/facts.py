"""The GPU check's first phase: what the machine is, and the versions every later phase imports.

Every module the later phases need is imported here, one at a time, so a package the image and
the bundle both lack is named first, and the versions reported are the ones actually imported."""

from __future__ import annotations

import gc
import importlib
import platform
import subprocess
import sys
import traceback
from importlib.metadata import packages_distributions, version
from typing import Any

from benchmarks.gpu import Lines, phase_parser

# What the phases import: the server (serve phase), the gpu-marked test modules and their
# conftest (tests phase), the real-shape benchmarks (bench, compile and serve:flux phases)
NEEDED = (
    "torch",
    "diffusers",
    "transformers",
    "torchao",
    "server.app",
    "server.__main__",
    "tests.conftest",
    "tests.test_gpu",
    "tests.test_metrics",
    "benchmarks.gpu.models",
    "benchmarks.gpu.compiled",
    "benchmarks.gpu.served",
    "benchmarks.gpu.served_flux",
)
# torch features we use that a release may lack: (what, how to look it up)
TORCH_FEATURES = {
    "torch.compiler.save_cache_artifacts": ("torch.compiler", "save_cache_artifacts"),
    "torch.compiler.load_compiled_function": ("torch.compiler", "load_compiled_function"),
    "torch.compiler.skip_all_guards_unsafe": ("torch.compiler", "skip_all_guards_unsafe"),
    "torch._C._set_sdp_priority_order": ("torch._C", "_set_sdp_priority_order"),  # --attention
    "torch.nn.functional.scaled_dot_product_attention": (
        "torch.nn.functional",
        "scaled_dot_product_attention",
    ),
}


def imports() -> dict[str, str]:
    """Each needed module imported: "ok", or the error's last line."""
    outcome = {}
    for name in NEEDED:
        try:
            importlib.import_module(name)
            outcome[name] = "ok"
        except Exception as error:
            outcome[name] = traceback.format_exception_only(error)[-1].strip()
    return outcome


def imported_versions() -> dict[str, str]:
    """distribution → version, for every distribution a module in sys.modules belongs to."""
    owners = packages_distributions()
    found = {}
    for module in list(sys.modules):
        for dist in owners.get(module.partition(".")[0], ()):
            try:
                found[dist] = version(dist)
            except Exception:
                continue
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def gpu_facts(torch: Any) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda_available": False}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    facts = {
        "cuda_available": True,
        "count": torch.cuda.device_count(),
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "total_gib": round(total / 2**30, 1),
        "free_gib": round(free / 2**30, 1),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,memory.used,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        facts["nvidia_smi"] = smi
        facts["driver"] = smi.split(",")[0].strip()
    except (OSError, subprocess.SubprocessError) as error:
        facts["nvidia_smi"] = f"unavailable: {error}"
    return facts


def torch_features(torch: Any) -> dict[str, bool]:
    found = {}
    for what, (module, name) in TORCH_FEATURES.items():
        found[what] = hasattr(importlib.import_module(module), name)
    found["torch.compile(...).aot_compile"] = hasattr(torch.compile(lambda x: x), "aot_compile")
    return found


def main() -> None:
    args = phase_parser(__doc__).parse_args()
    lines = Lines(args.lines)
    import torch

    gpu = gpu_facts(torch)
    lines.write({"gpu": gpu, "python": platform.python_version(), "torch": torch.__version__})
    outcome = imports()
    features = torch_features(torch)
    versions = imported_versions()
    failed = {name: why for name, why in outcome.items() if why != "ok"}
    lines.write({"imports": outcome, "torch_features": features, "imported": versions})
    where = (
        f"{gpu['name']} {gpu['total_gib']} GiB, {gpu['free_gib']} free" if gpu["cuda_available"] else "no GPU"
    )
    missing = [what for what, ok in features.items() if not ok]
    lines.write(
        {
            "headline": f"{where}; torch {torch.__version__} CUDA {torch.version.cuda}; "
            f"diffusers {versions.get('diffusers', '?')}; "
            + (f"IMPORT FAILED: {', '.join(failed)}" if failed else "imports ok")
            + (f"; torch lacks {', '.join(missing)}" if missing else "")
        }
    )
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
    gc.freeze()  # exit skips sweeping every module's objects (~1.5 s a phase)
