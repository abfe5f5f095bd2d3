"""The planner's disk cache: calibrations and measured block costs, as small JSON files of
(key, value) entries in the cache directory (`--cache-dir`). A cache that cannot be read is
empty; one that cannot be written only warns (the numbers are timed again next time)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("diffshard")
_warned: set[Path] = set()  # a cache that cannot be written is said once per process


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/diffshard`, i.e. `~/.cache/diffshard` by default."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "diffshard"


def lookup(path: Path | None, key: dict[str, Any]) -> Any | None:
    """The value stored under `key` in the file at `path`, or None."""
    return next((e["value"] for e in _entries(path) if e.get("key") == key and "value" in e), None)


def store(path: Path | None, key: dict[str, Any], value: Any) -> None:
    """Keep `value` under `key` (replacing an older one); warn if the file cannot be written."""
    if path is None:
        return
    entries = [e for e in _entries(path) if e.get("key") != key] + [{"key": key, "value": value}]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"entries": entries}, indent=1))
        tmp.replace(path)  # whole or not at all: two processes writing leave one's file
    except OSError as err:
        if path not in _warned:
            _warned.add(path)
            log.warning("cannot write the planner's cache %s (%s): it is measured again next time", path, err)


def _entries(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        return []
    try:
        entries = json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
