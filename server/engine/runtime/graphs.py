"""Compiled graphs on disk: precompiled functions (`torch.compile(...).aot_compile`) kept in the
cache directory with inductor's kernels beside them, keyed by what they were compiled from, so a
second start loads them without tracing. See `compile.py` for how they are used."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType
from typing import Any

import torch
from torch._C._dynamo.eval_frame import reset_code
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from server.engine.hardware.devices import device_kind

log = logging.getLogger("diffshard")


def compiled_for(device: torch.device) -> str:
    """What compiled code is specific to: the GPU model and capability, or the CPU and its ISA."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{device_kind(str(device))} sm{major}{minor}"
    return f"{device_kind(str(device))} {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def prepare_compiler() -> threading.Thread:
    """Start what every compile or load waits for first, in the background: inductor's probe of
    the CPU's vector ISA (it builds and runs test programs: ~1 s) and its imports."""

    def prepare() -> None:
        from torch._inductor import codecache, cpu_vec_isa  # noqa: F401  (imports: the point)

        cpu_vec_isa.valid_vec_isa_list()  # cached for the process

    thread = threading.Thread(target=prepare, name="prepare-compiler", daemon=True)
    thread.start()
    return thread


@dataclass
class CompileStats:
    """Progress while warming, then which path calls took."""

    mode: str
    graphs_total: int = 0
    graphs_ready: int = 0
    loaded: int = 0  # from the cache
    compiled: int = 0  # traced and compiled here
    frozen: int = 0  # of the graphs in use, those with their weights folded in (CPU)
    attention: Counter[str] = field(default_factory=Counter)  # frozen graphs' attention shapes by kernel
    seconds: float = 0.0
    calls: dict[str, int] = field(default_factory=lambda: {"compiled": 0, "padded": 0, "eager": 0})
    state: str = "waiting"  # then compiling (in the background), and ready, stopped (budget), failed or off
    buckets: list[dict[str, Any]] = field(default_factory=list)  # each one's timing, and if kept
    done: threading.Event = field(default_factory=threading.Event)  # set once it ended, either way

    def finish(self, state: str) -> None:
        self.state = state
        self.done.set()

    def view(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "state": self.state,
            "graphs": {"ready": self.graphs_ready, "total": self.graphs_total},
            "loaded": self.loaded,
            "compiled": self.compiled,
            "frozen": self.frozen,
            "attention": dict(+self.attention),  # frozen graphs' attention shapes by kernel
            "seconds": round(self.seconds, 2),
            "calls": dict(self.calls),
            "buckets": list(self.buckets),
        }


def compile_refusal() -> str | None:
    """Why this PyTorch cannot compile as `--compile` does, or None. Graphs are compiled ahead of
    time (`torch.compile(...).aot_compile`, kept on disk): PyTorch 2.11 (the lent GPUs') lacks it,
    and tracing there instead failed inside dynamo on FLUX's blocks (KeyError 'norm1')."""
    if hasattr(torch.compile(lambda x: x), "aot_compile"):
        return None
    return f"--compile needs PyTorch 2.13's ahead-of-time compile, which torch {torch.__version__} lacks"


class GraphStore:
    """Precompiled functions on disk and in memory, by a key of what they were compiled from."""

    def __init__(
        self,
        folder: Path | None,
        devices: torch.device | Sequence[torch.device | str],
        stats: CompileStats,
        threads: int | None = None,
    ) -> None:
        self.folder = folder if folder is None else _writable(folder / "compiled")
        # every device the compiled code runs on: a cuda:0 + cpu split holds kernels for both
        listed = [devices] if isinstance(devices, torch.device) else devices
        self.device_kind = " + ".join(dict.fromkeys(compiled_for(torch.device(d)) for d in listed))
        # inductor writes the intra-op threads it sees into its CPU kernels: the callers' count
        self.threads = threads or torch.get_num_threads()
        self.stats = stats
        self._loaded: dict[str, Any] = {}
        self._frozen_code: dict[str, CodeType] = {}  # a frozen graph's function's code (`release`)
        self._lock = threading.Lock()
        # Compiled kernels beside the graphs (one volume keeps both), unless the operator chose a
        # writable place: inductor writes its default into the environment when first imported.
        kernels = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if self.folder is not None and kernels in (None, default_cache_dir()):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.folder / "inductor")
        elif self.folder is None and folder is not None and kernels and Path(kernels).is_relative_to(folder):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "torchinductor")

    def key(self, what: dict[str, Any]) -> str:
        described = {**what, "torch": torch.__version__, "device": self.device_kind, "guards": None,
                     "threads": self.threads}  # fmt: skip
        return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def get(self, key: str, fn: Callable, example: tuple, external: dict[str, Any]) -> Any:
        """The function compiled for `example` (its args): in memory, from disk, or compiled now."""
        with self._lock:
            if key in self._loaded:
                return self._loaded[key]
            compiled = self._read(key, external)
            if compiled is None:
                compiled = self._compile(fn, example)
                self._write(key, compiled, external)
                self.stats.compiled += 1
            else:
                self.stats.loaded += 1
            compiled.disable_guard_check()  # `signature` is checked before every call instead
            self._loaded[key] = compiled
            return compiled

    def frozen(self, key: str, fn: Callable, example: tuple) -> Callable:
        """`fn` (a function holding its model: `frozen.Freezer`) compiled with inductor's
        freezing for `example`'s shapes, just in time, at every start: its kernels' C++ builds
        come from inductor's cache under the cache directory, but the graph is never kept whole
        (`aot_compile` cannot freeze in torch 2.13, and inductor's graph cache cannot keep the
        prepacked weights: oneDNN's tensors do not pickle)."""
        with self._lock:
            if key in self._loaded:
                return self._loaded[key]
            # no guards (each frozen graph's code is its own, and `signature` is checked before
            # every call): an adapter's hooks attached later would fail the model's, and dynamo
            # would compile again on the serving path
            options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
            compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
            # freezing is read from inductor's config while the graph is traced: in `options` it
            # is not (the SD-1.5 UNet ran 1.0 s a call that way against 0.54 s frozen)
            with torch.inference_mode(), inductor_config.patch(freezing=True):
                compiled(*example)
            self.stats.compiled += 1
            self._loaded[key] = compiled
            self._frozen_code[key] = fn.__code__
            return compiled

    def release(self, key: str) -> None:
        """Forget a frozen graph (measured slower, or failed): dynamo's entries for its code go
        with it, and its copy of the weights is freed once no call holds it."""
        with self._lock:
            self._loaded.pop(key, None)
            if (code := self._frozen_code.pop(key, None)) is not None:
                reset_code(code)

    def _path(self, key: str) -> Path | None:
        return None if self.folder is None else self.folder / "compiled" / f"{key}.bin"

    def _read(self, key: str, external: dict[str, Any]) -> Any | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            with path.open("rb") as file:
                return torch.compiler.load_compiled_function(file, external_data=external)
        except Exception as err:  # stale (another torch or machine) or corrupt: compile again
            kind = type(err).__name__
            log.warning("compile cache %s is unusable (%s: %s); compiling again", path, kind, err)
            return None

    @staticmethod
    def _compile(fn: Callable, example: tuple) -> Any:
        compiled = torch.compile(
            fn,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},  # `signature` instead
        )
        with torch.inference_mode():
            return compiled.aot_compile((example, {}))

    def _write(self, key: str, compiled: Any, external: dict[str, Any]) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path), external_data=external)
        except Exception as err:
            log.warning("cannot keep the compiled graph %s (%s): it is compiled again next start", path, err)


def _writable(folder: Path) -> Path | None:
    """`folder`'s parent (the cache dir) if graphs can be kept there, else None, with a warning."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        log.warning(
            "cannot keep compiled graphs in %s (%s): they are compiled again at every start", folder, err
        )
        return None
    return folder.parent
