"""A modular pipeline's folder (`modular_model_index.json`, no `model_index.json`: FLUX.3's) read as
the classic index the loader reads.

Each part the modular index lists is `[library, class, spec]`, the spec saying where it loads
from: a repository id and a subfolder. A download (`hf download --local-dir`) keeps the Hub's id,
so, as diffusers does, a part whose subfolder is in the folder loads from there; one that is not
names another repository, which a server that never downloads cannot load: it is refused, saying
where to put it. Parts listed `[null, null, spec]` are not loaded (the blocks' optional parts:
FLUX.3's prompt upsampler). The rest of the index (the class, the blocks' configs) is kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server.errors import ModelFolderError

INDEX = "modular_model_index.json"


def classic_index(modular: dict[str, Any], root: Path) -> dict[str, Any]:
    """`modular` (a folder's modular index) as `model_index.json` would say it: `[library, class]`
    for each part found in the folder under its own name."""
    index: dict[str, Any] = {}
    for name, entry in modular.items():
        if not (isinstance(entry, list | tuple) and len(entry) == 3 and isinstance(entry[2], dict)):
            index[name] = entry  # the class name, the blocks', a config value
            continue
        library, class_name, spec = entry
        if library is None:
            continue  # not part of this folder's pipeline (an optional component left unset)
        subfolder = spec.get("subfolder") or ""
        if subfolder != name:
            raise ModelFolderError(
                f"{root}/{INDEX} loads {name} from {subfolder or 'the top of'} "
                f"{spec.get('pretrained_model_name_or_path')!r}; diffshard loads each part from the "
                f"folder's own {name}/: put it there and set its subfolder to {name!r}"
            )
        if not (root / subfolder).is_dir():
            raise ModelFolderError(
                f"{root}/{INDEX} loads {name} from {spec.get('pretrained_model_name_or_path')!r}, which is "
                f"not in this folder: download that repository's {subfolder}/ into {root / subfolder}"
            )
        index[name] = [library, class_name]
    return index
