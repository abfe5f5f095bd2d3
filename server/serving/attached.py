"""What a service serves beside its model and an operator changes at runtime: LoRA adapters and
ControlNets (admin routes, api/admin.py). Jobs hold the ones they ask for; one unloaded while
held stays until its last job ends, and new requests naming it get 400 meanwhile."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from server.errors import InvalidRequest, ModelFolderError
from server.pipeline import Pipeline
from server.pipeline.conditioning.controlnets import runtime_controlnet
from server.pipeline.conditioning.live_changes import adapter_file
from server.pipeline.conditioning.lora_keys import read_adapter
from server.requests import GenerationRequest

log = logging.getLogger("diffshard")


class Attached:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def hold(self, requests: Sequence[GenerationRequest]) -> Callable[[], None]:
        """Hold what a job's requests ask for; the call that releases it (once, however the job
        ends). InvalidRequest if one is unloading (nothing held then)."""
        adapters, nets = self.pipeline.adapters, self.pipeline.controlnets
        held = {name for r in requests for name, _ in r.lora}
        controls = {c.model for r in requests for c in r.control}
        adapters.uses.hold(held)
        try:
            nets.hold(controls)
        except BaseException:
            adapters.release(held)
            raise

        def release() -> None:
            adapters.release(held)
            nets.release(controls)

        return release

    def adapters(self) -> list[dict[str, Any]]:
        """The LoRA adapters served: name, rank, parts, target modules, bytes (not those leaving)."""
        leaving, loaded = set(self.pipeline.adapters.uses.leaving), self.pipeline.adapters.loaded
        return [a.describe() | {"bytes": a.bytes} for a in list(loaded.values()) if a.name not in leaving]

    def serves_adapter(self, name: str) -> bool:
        """Whether `name` is attached (served, or unloading while requests still use it)."""
        return name in self.pipeline.adapters.loaded

    def load_adapter(self, name: str, file: str, folder: Path) -> dict[str, Any]:
        """Serve `folder`/`file` as adapter `name` from the next step on (blocks until the calls in
        flight end). Only a .safetensors file inside `folder`: a client never names a server path.
        InvalidRequest says what is wrong (`name` or `file`)."""
        path = adapter_file(name, file, folder)
        try:
            adapter = read_adapter(name, path, self.pipeline.family)
        except Exception as error:  # not LoRA weights, or not readable: the operator's file, said
            raise InvalidRequest("file", f"{file!r}: {error}") from error
        try:
            self.pipeline.add_adapter(adapter)
        except ModelFolderError as error:  # a file that does not fit, or a name taken meanwhile
            raise InvalidRequest("file", str(error)) from error
        log.info("LoRA %s loaded at runtime: %s", name, adapter.describe())
        return adapter.describe() | {"bytes": adapter.bytes}

    def unload_adapter(self, name: str) -> int:
        """Stop serving `name`: new requests for it get 400; it stays attached until the last job
        holding it ends. The jobs still holding it (0: detached now). KeyError if not served."""
        return _unload(self.pipeline.adapters, name, "LoRA")

    def controlnets(self) -> list[dict[str, Any]]:
        """The ControlNets served: name, class, the family it fits, bytes (not those leaving)."""
        return self.pipeline.controlnets.describe()

    def serves_controlnet(self, name: str) -> bool:
        """Whether `name` is loaded (served, or unloading while requests still use it)."""
        return name in self.pipeline.controlnets.loaded

    def load_controlnet(self, name: str, folder: str, root: Path) -> dict[str, Any]:
        """Serve `root`/`folder` as ControlNet `name` from the next request on. Only a folder
        inside `root`: a client never names a server path. InvalidRequest says what is wrong."""
        nets = self.pipeline.controlnets
        path = runtime_controlnet(name, folder, root)
        try:
            nets.load(name, path)
        except ValueError as error:  # not one this model takes, or a name taken meanwhile
            raise InvalidRequest("folder", str(error)) from error
        except Exception as error:  # unreadable weights: the operator's log has the why and the path
            log.warning("ControlNet %s from %s did not load: %r", name, path, error)
            message = f"{folder!r} did not load ({type(error).__name__}): its weights are unreadable"
            raise InvalidRequest("folder", message) from error
        log.info("ControlNet %s loaded at runtime from %s", name, path)
        return next(net for net in nets.describe() if net["name"] == name)

    def unload_controlnet(self, name: str) -> int:
        """As `unload_adapter`: new requests naming it get 400; it goes when the last job holding
        it ends. The jobs still holding it (0: gone now). KeyError if not served."""
        return _unload(self.pipeline.controlnets, name, "ControlNet")


def _unload(served: Any, name: str, what: str) -> int:
    """Mark `name` of `served` (Adapters or ControlNets: their `loaded`, `uses` and `remove`)
    leaving, and remove it now if no job holds it. The jobs holding it; KeyError if not served."""
    if name not in served.loaded or name in served.uses.leaving:
        raise KeyError(name)
    users = served.uses.leave(name)
    if users == 0:
        served.remove(name)
    log.info("%s %s unloading: %d request(s) still use it", what, name, users)
    return users
