"""Every list of fault markers names them all. The markers are server/serving/faults.py's (the
table in its docstring); the settings, the startup warning, the settings page (docs/serving.md),
the architecture map and the Prometheus alert (three copies) list them too, and had drifted apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from server.serving import faults

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"\[\[\w+\]\]")
FAULTS = Path(faults.__file__)


def markers(text: str) -> set[str]:
    return set(MARKER.findall(text))


def lists_of_markers() -> list[Path]:
    """Every file outside tests that names [[fail]], where a list of markers starts."""
    candidates = [
        *(ROOT / "server").rglob("*.py"),
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "deploy").rglob("*.y*ml"),
    ]
    return [path for path in candidates if path != FAULTS and "[[fail]]" in path.read_text()]


def test_the_docstring_table_lists_exactly_the_markers_the_code_acts_on() -> None:
    module = ast.parse(FAULTS.read_text())
    docstring = ast.get_docstring(module) or ""
    code = "".join(
        node.value
        for node in ast.walk(module)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ).replace(docstring, "")
    assert markers(docstring) == markers(code)


def test_every_list_of_fault_markers_names_them_all() -> None:
    known = markers(faults.__doc__ or "")
    found = lists_of_markers()
    assert len(found) >= 5  # config.py, app.py, docs/serving.md, docs/architecture.md, the alerts
    missing = {str(path.relative_to(ROOT)): sorted(known - markers(path.read_text())) for path in found}
    assert not {path: lacks for path, lacks in missing.items() if lacks}
