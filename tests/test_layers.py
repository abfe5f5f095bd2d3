"""The package's shape, checked: layers import downwards only (api → serving → pipeline → engine,
with request values, media and errors beneath them all), the API sees only what serving owns and
the shared values (wherever a name is re-exported), no import cycles in the server or the
benchmarks (imports inside functions and under TYPE_CHECKING count too), rooms a newcomer can
read, and model families named only inside pipeline/."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "server"
# A module may import its own layer and those below it. `errors`, `requests` (what a request
# asks for, as values), `media` (pixels as bytes) and `demo` (the built-in model's data) sit at
# the bottom; `settings`, `metrics`, `app`, `startup` and the CLI wire layers together.
RANKS = {
    "errors": 0,
    "requests": 0,
    "media": 0,
    "demo": 0,
    "engine": 1,
    "pipeline": 2,
    "serving": 3,
    "api": 4,
    "metrics": 4,
    "settings": 4,
    "app": 5,
    "startup": 5,
    "__main__": 6,
    "__init__": 0,
}
# The HTTP layer uses names defined in its own layer, in serving, or beneath them all: never the
# pipeline's or the engine's, however they are re-exported (what a route needs, serving owns).
API_SEES = {"api", "serving", "errors", "requests", "media", "__init__"}
# A smoke alarm, not a target: a module's edges follow its meaning (docs/architecture.md).
MAX_LINES = 800
MAX_ROOM_FILES = 15  # modules in one package of pipeline/, its __init__ aside
# names one suffix apart that hold different concerns: tensor parallelism (planned, run), and the
# tensors of simulated GPUs
SIMULATED_TENSORS = "server.engine.hardware.simulated.tensors"
APART = {(f"server.engine.{room}.tensor", SIMULATED_TENSORS) for room in ("planning", "runtime")}
FAMILY_NAMES = re.compile(r"\b(sd15|sd21|sdxl|sd3)\b|[\"']sd[\"']", re.IGNORECASE)


def modules(*tops: str) -> dict[str, Path]:
    """Module name → file, for the packages `tops` (the server alone by default)."""
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for top in tops or ("server",)
        for path in (ROOT / top).rglob("*.py")
    }


def imports(path: Path, known: set[str]) -> set[str]:
    """Every module of `known` that `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name in known}
    return found


def graph(*tops: str) -> dict[str, set[str]]:
    found = modules(*tops)
    return {name: imports(path, set(found)) for name, path in found.items()}


@cache
def defined_in(module: str, name: str) -> str:
    """The module that defines `name` as `module` offers it, following re-exports."""
    found = modules()
    if f"{module}.{name}" in found:  # a package's submodule
        return f"{module}.{name}"
    for node in ast.parse(found[module].read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module in found:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return defined_in(node.module, alias.name)
    return module


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def used_names(path: Path) -> list[tuple[str, str]]:
    """(module, name) for each name `path` imports from a server module, anywhere in the file."""
    return [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("server")
        for alias in node.names
    ]


def test_layers_import_only_downwards() -> None:
    upward = [
        f"{module} → {target}"
        for module, targets in graph().items()
        for target in targets
        if RANKS[layer(target)] > RANKS[layer(module)]
    ]
    assert not upward, f"imports that point up a layer: {upward}"


def test_the_api_uses_only_names_serving_owns_or_the_shared_values() -> None:
    """However a name travels (a package's `__init__`, a module that imports it), what counts is
    where it is defined: a route never reaches into the pipeline or the engine."""
    reaching = [
        f"{name} → {path.relative_to(ROOT)}: {name_used} from {source} (defined in {defined})"
        for name, path in modules().items()
        if layer(name) == "api"
        for source, name_used in used_names(path)
        if layer(defined := defined_in(source, name_used)) not in API_SEES
    ]
    assert not reaching, f"API modules using names from below serving: {reaching}"


def test_the_layer_check_sees_through_a_re_export() -> None:
    """The check above is not blind: a name serving re-exported from the pipeline resolves to it."""
    assert layer(defined_in("server.serving.loop", "Pipeline")) == "pipeline"
    assert defined_in("server.requests", "GenerationRequest") == "server.requests.generation"


def test_the_api_reads_the_settings_only_through_its_slices() -> None:
    """Routes read `app.state.server_settings`, `model_settings`, `limit_settings` (server/app.py
    sets them: `Concern.of`), never the whole `Settings`."""
    whole = [
        f"{path.relative_to(ROOT)}:{number}"
        for name, path in modules().items()
        if layer(name) == "api"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "state.settings" in line
    ]
    assert not whole, f"API modules reading the whole settings: {whole}"


def test_there_is_no_import_cycle_in_the_server_or_the_benchmarks() -> None:
    edges = graph("server", "benchmarks")
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


def test_no_module_is_over_the_ceiling() -> None:
    long = {
        name: n
        for name, path in modules("server", "benchmarks").items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by meaning): {long}"


def test_pipeline_rooms_are_small_and_hold_no_twins() -> None:
    """No room of pipeline/ over ~15 modules, and no two server modules whose names differ only
    by a suffix (compile/compiling, lora/lorafiles): a reader cannot tell such twins apart."""
    rooms = {path.parent for path in (SERVER / "pipeline").rglob("*.py")}
    crowded = {
        str(room.relative_to(SERVER)): n
        for room in rooms
        if (n := len([p for p in room.glob("*.py") if p.name != "__init__.py"])) > MAX_ROOM_FILES
    }
    assert not crowded, f"pipeline rooms over {MAX_ROOM_FILES} modules: {crowded}"
    by_layer: dict[str, set[str]] = {}
    for name in modules():
        if "." in name and not name.endswith("__main__"):
            by_layer.setdefault(layer(name), set()).add(name)
    twins = [
        (one, other)
        for names in by_layer.values()
        for one in names
        for other in names
        if _suffixed(one.rsplit(".", 1)[1], other.rsplit(".", 1)[1])
        and not other.startswith(one + ".")  # a package's own modules (planning/plan.py)
        and not one.startswith(other + ".")
        and (one, other) not in APART
    ]
    assert not twins, f"module names in one layer that differ only by a suffix: {twins}"


def _suffixed(stem: str, other: str) -> bool:
    """Whether `other` is `stem` with a suffix that leaves its concern unchanged."""
    bases = {stem, stem.removesuffix("e"), stem + stem[-1]}  # compile → compiling, plan → planned
    return any(other == base + suffix for base in bases for suffix in ("s", "ing", "ed", "files", "_backend"))


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


@pytest.mark.parametrize("module", ["server.requests", "server.api.errors", "server.errors"])
def test_request_values_and_the_error_table_import_no_torch(module: str) -> None:
    """What every layer shares, and the API's error table, stay light: importing them loads no
    torch (a client of the values, or a test of the envelope, pays nothing for the model)."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
