"""The package's shape, checked: layers import downwards only (api → serving → pipeline → engine),
no import cycles (imports inside functions and under TYPE_CHECKING count too), small modules,
and model families named only inside pipeline/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[1] / "server"
# A module may import its own layer and those below it. `errors` and `demo` (the built-in
# model's data) sit at the bottom; `config`, `metrics`, `app` and the CLI wire layers together.
RANKS = {
    "errors": 0,
    "demo": 0,
    "engine": 1,
    "pipeline": 2,
    "serving": 3,
    "api": 4,
    "metrics": 4,
    "config": 4,
    "config_values": 4,
    "app": 5,
    "planned": 5,
    "__main__": 6,
    "__init__": 0,
}
CHAIN = ("engine", "pipeline", "serving", "api")  # each imports only its own layer and the next below
MAX_LINES = 400
FAMILY_NAMES = re.compile(r"\b(sd15|sd21|sdxl|sd3)\b|[\"']sd[\"']", re.IGNORECASE)


def modules() -> dict[str, Path]:
    return {
        ".".join(("server", *path.relative_to(SERVER).with_suffix("").parts)).removesuffix(".__init__"): path
        for path in SERVER.rglob("*.py")
    }


def imports(path: Path, known: set[str]) -> set[str]:
    """Every server module `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name in known}
    return found


def graph() -> dict[str, set[str]]:
    known = set(modules())
    return {name: imports(path, known) for name, path in modules().items()}


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_layers_import_only_downwards() -> None:
    upward = [
        f"{module} → {target}"
        for module, targets in graph().items()
        for target in targets
        if RANKS[layer(target)] > RANKS[layer(module)]
    ]
    assert not upward, f"imports that point up a layer: {upward}"


def test_each_layer_of_the_chain_imports_only_the_one_below() -> None:
    """api → serving → pipeline → engine, strictly: a route never reaches the pipeline, the
    serving layer never the engine (what they need is re-exported by the layer below)."""
    skipping = [
        f"{module} → {target}"
        for module, targets in graph().items()
        for target in targets
        if layer(module) in CHAIN
        and layer(target) in CHAIN
        and CHAIN.index(layer(module)) - CHAIN.index(layer(target)) > 1
    ]
    assert not skipping, f"imports that skip a layer: {skipping}"


def test_there_is_no_import_cycle() -> None:
    edges = graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            pytest.fail("import cycle: " + " → ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(edges[module]):
            if target != module and not module.startswith(target + "."):  # a package's own __init__
                visit(target, [*path, module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])


def test_no_module_is_over_400_lines() -> None:
    long = {
        name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_family_names_appear_only_in_the_pipeline_families() -> None:
    """Nothing outside pipeline/ branches on a family: it asks the family registry."""
    named = [
        f"{path.relative_to(SERVER)}:{i}"
        for path in SERVER.rglob("*.py")
        if path.relative_to(SERVER).parts[0] != "pipeline"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if FAMILY_NAMES.search(line)
    ]
    assert not named, f"family names outside server/pipeline/: {named}"


def test_no_per_call_state_lives_in_a_thread_local() -> None:
    """A call carries its state in its call plan and the slots the walker fills, never in a
    thread-local (a rank, a measurement's uncounted calls). The exceptions say what a thread is
    doing, not a call (`runtime/tracing.py`): the compile-thread flag, since
    `torch.compiler.is_compiling()` answers for every thread, and whether this thread holds a lock
    the step loops take (`holding_shared`), which the compile's trace function asks of its own;
    and, on simulated GPUs (`hardware/simulated/`), CUDA's own per-thread state: a thread's
    current device, and the mode each thread enters to see CUDA devices named."""
    simulated = SERVER / "engine" / "hardware" / "simulated"
    allowed = {
        SERVER / "engine" / "runtime" / "tracing.py": 2,
        simulated / "gpus.py": 1,
        simulated / "__init__.py": 1,
    }
    found = {
        path: n
        for room in ("engine", "pipeline")
        for path in (SERVER / room).rglob("*.py")
        if (n := path.read_text().count("threading.local("))
    }
    assert found == allowed, found
