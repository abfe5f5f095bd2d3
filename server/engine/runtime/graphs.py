"""Compiled graphs, by a key of what they were compiled from, on one of two routes (`--compile-route`):
- `aot`: precompiled functions (`torch.compile(...).aot_compile`) kept in the cache directory with
  inductor's kernels beside them, so a second start loads them without tracing;
- `jit`: compiled just in time (`torch.compile`, each graph under a code object of its own), for a
  PyTorch without `aot_compile` (2.11, the lent GPUs'); a restart traces again but compiles
  little: inductor's caches live in the cache directory, and what this start compiled is kept
  there as one file of cache artifacts (`torch.compiler.save_cache_artifacts`), loaded first.
`auto` takes `aot` where this PyTorch has it. See `compile.py` for how graphs are used."""

from __future__ import annotations

import enum
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import CodeType
from typing import Any

import torch
from torch import nn
from torch._C._dynamo.eval_frame import reset_code
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from server.engine.hardware.devices import device_kind
from server.engine.runtime import packages

log = logging.getLogger("diffshard")

SERVER = Path(__file__).parents[2]
TRACED = ("engine", "pipeline")  # of `server/`: the code a graph's trace runs (walker, families)


@cache
def traced_code(root: Path = SERVER) -> str:
    """A digest of the code graphs are traced from: `root`'s engine and pipeline sources and
    diffusers' version. In every graph's key, so a graph kept by another release (a family's
    forward fixed since, say) is traced again, never loaded in place of what this code traces."""
    digest = hashlib.sha256(importlib.metadata.version("diffusers").encode())
    for source in sorted(file for part in TRACED for file in (root / part).rglob("*.py")):
        digest.update(str(source.relative_to(root)).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


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
    route: str = ""  # aot or jit (`GraphStore`)
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
            "route": self.route,
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


class CompileRoute(enum.StrEnum):
    AUTO = "auto"  # aot where this PyTorch has it, else jit
    AOT = "aot"
    JIT = "jit"


def aot_available() -> bool:
    """Whether this PyTorch compiles ahead of time (`aot_compile`: 2.13 has it, 2.11 does not)."""
    return hasattr(torch.compile(lambda x: x), "aot_compile")


def compile_route(route: CompileRoute | str = CompileRoute.AUTO) -> CompileRoute:
    """The route `route` takes on this PyTorch; `aot` where it lacks `aot_compile` is refused."""
    route = CompileRoute(route)
    if route == CompileRoute.AUTO:
        return CompileRoute.AOT if aot_available() else CompileRoute.JIT
    if route == CompileRoute.AOT and not aot_available():
        raise ValueError(
            f"--compile-route aot needs PyTorch's ahead-of-time compile (aot_compile), which torch "
            f"{torch.__version__} lacks: use --compile-route jit (or auto)"
        )
    return route


def unguarded(fn: Callable) -> Callable:
    """`fn` under `torch.compile` as every graph here is made: whole, static shapes, and without
    dynamo's guards (`signature` is checked before every call instead): an adapter's hooks
    attached later would fail the model's, and dynamo would compile again on the serving path."""
    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


def own_code(fn: Callable, name: str) -> Callable:
    """`fn` under a code object of its own named `name`: dynamo keeps graphs per code object, so
    one graph (a bucket's, a model's) is never another's, and `GraphStore.release` frees it alone."""
    fn.__code__ = fn.__code__.replace(co_name=name, co_qualname=name)
    return fn


class GraphStore:
    """Precompiled functions on disk and in memory, by a key of what they were compiled from."""

    def __init__(
        self,
        folder: Path | None,
        devices: torch.device | Sequence[torch.device | str],
        stats: CompileStats,
        threads: int | None = None,
        route: CompileRoute | str = CompileRoute.AUTO,
        kept_bytes: int = packages.KEPT_BYTES,
        checkpoint: Callable[[], None] = lambda: None,
    ) -> None:
        self.route = compile_route(route)
        self.kept_bytes = kept_bytes  # of frozen graphs' libraries in the folder
        self.checkpoint = checkpoint  # called while a library builds in its own process (`packages.build`)
        stats.route = str(self.route)
        self.folder = folder if folder is None else _writable(folder / "compiled")
        # every device the compiled code runs on: a cuda:0 + cpu split holds kernels for both
        listed = [devices] if isinstance(devices, torch.device) else devices
        self.device_kind = " + ".join(dict.fromkeys(compiled_for(torch.device(d)) for d in listed))
        # inductor writes the intra-op threads it sees into its CPU kernels: the callers' count
        self.threads = threads or torch.get_num_threads()
        self.stats = stats
        self._loaded: dict[str, Any] = {}
        self._frozen_code: dict[str, CodeType] = {}  # a frozen graph's function's code (`release`)
        self._libraries: set[Path] = set()  # frozen graphs' libraries this store has open
        self._lock = threading.Lock()
        # Compiled kernels beside the graphs (one volume keeps both), unless the operator chose a
        # writable place: inductor writes its default into the environment when first imported.
        kernels = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if self.folder is not None and kernels in (None, default_cache_dir()):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.folder / "inductor")
        elif self.folder is None and folder is not None and kernels and Path(kernels).is_relative_to(folder):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "torchinductor")
        if self.route == CompileRoute.JIT:
            self._load_artifacts()

    def key(self, what: dict[str, Any]) -> str:
        described = {
            **what,
            "torch": torch.__version__,
            "code": traced_code(),
            "device": self.device_kind,
            "guards": None,
            "threads": self.threads,
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def get(self, key: str, fn: Callable, example: tuple, external: dict[str, Any]) -> Any:
        """The function compiled for `example` (its args): in memory, from disk, or compiled now.
        `signature` is checked before every call instead of dynamo's guards."""
        with self._lock:
            if key in self._loaded:
                return self._loaded[key]
            if self.route == CompileRoute.JIT:
                compiled = self._jit(key, fn, example)
                self.stats.compiled += 1
            elif (compiled := self._read(key, external)) is None:
                compiled = self._compile(fn, example)
                self._write(key, compiled, external)
                self.stats.compiled += 1
            else:
                self.stats.loaded += 1
            if self.route == CompileRoute.AOT:
                compiled.disable_guard_check()
            self._loaded[key] = compiled
            return compiled

    def keep_artifacts(self) -> None:
        """On the jit route, what inductor and AOTAutograd compiled in this process, kept in the
        cache directory for the next start (`load_cache_artifacts` before its first trace)."""
        path = self._artifacts_path()
        if path is None:
            return
        try:
            saved = torch.compiler.save_cache_artifacts()
            if saved is not None:
                written = path.with_suffix(".tmp")
                written.write_bytes(saved[0])
                written.replace(path)
        except Exception as err:
            log.warning(
                "cannot keep the compile cache artifacts %s (%s): the next start compiles more", path, err
            )

    @property
    def keeps_frozen(self) -> bool:
        """Whether frozen graphs are kept on disk (`packages.py`): the aot route, a cache directory
        and room for them."""
        return self.route == CompileRoute.AOT and self.folder is not None and self.kept_bytes > 0

    def frozen(
        self,
        key: str,
        trace: Callable[[], tuple[Callable, list[str]]],
        example: tuple,
        model: nn.Module,
        kept: str | None = None,
    ) -> tuple[Callable, list[str]]:
        """A graph of `model`'s call with its weights folded in (inductor's freezing) for `example`'s
        shapes, and the attention kernels it routes; `trace()` gives the function to freeze (holding
        `model`) and those kernels. Kept by `kept` (a key naming the weights' content) where
        `keeps_frozen`: an AOTInductor library loaded at the next start (`packages.py`); else frozen
        just in time, at every start (its kernels' C++ builds come from inductor's cache)."""
        with self._lock:
            if key in self._loaded:
                return self._loaded[key]
            path = None if kept is None or not self.keeps_frozen else self._path(kept, packages.SUFFIX)
            frozen = None if path is None else packages.load(path)
            if frozen is not None:
                self.stats.loaded += 1
            else:
                fn, kernels = trace()
                frozen = None
                if path is not None:
                    frozen = packages.build(path, fn, model, example, kernels, self.checkpoint)
                if frozen is None:
                    compiled = unguarded(fn)  # each frozen graph's code is its own
                    # freezing is read from inductor's config while the graph is traced: in `options`
                    # it is not (the SD-1.5 UNet ran 1.0 s a call that way against 0.54 s frozen)
                    with torch.inference_mode(), inductor_config.patch(freezing=True):
                        compiled(*example)
                    self._frozen_code[key] = fn.__code__
                    frozen = (compiled, kernels)
                self.stats.compiled += 1
            if path is not None and isinstance(frozen[0], packages.Library):
                self._libraries.add(path)
                packages.prune(path.parent, self._libraries, self.kept_bytes)
            self._loaded[key] = frozen
            return frozen

    def release(self, key: str) -> None:
        """Forget a frozen graph (measured slower, or failed): dynamo's entries for its code go
        with it, and its copy of the weights is freed once no call holds it."""
        with self._lock:
            self._loaded.pop(key, None)
            if (code := self._frozen_code.pop(key, None)) is not None:
                reset_code(code)

    def _path(self, key: str, suffix: str = ".bin") -> Path | None:
        return None if self.folder is None else self.folder / "compiled" / f"{key}{suffix}"

    def _artifacts_path(self) -> Path | None:
        if self.route != CompileRoute.JIT or self.folder is None:
            return None
        return self.folder / "compiled" / f"artifacts-{self.key({'graph': 'jit artifacts'})}.bin"

    def _load_artifacts(self) -> None:
        path = self._artifacts_path()
        if path is None or not path.is_file():
            return
        try:
            torch.compiler.load_cache_artifacts(path.read_bytes())
        except Exception as err:  # another torch, or corrupt: compiled from scratch, kept again
            log.warning(
                "compile cache artifacts %s are unusable (%s: %s); compiling anew",
                path,
                type(err).__name__,
                err,
            )

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
    def _jit(key: str, fn: Callable, example: tuple) -> Callable:
        """`fn` compiled just in time for `example`, under a code object of its own and without
        guards (as the ahead-of-time route's), traced and compiled now."""

        def run(*args: Any) -> Any:
            return fn(*args)

        compiled = unguarded(own_code(run, f"graph_{key}"))
        with torch.inference_mode():
            compiled(*example)
        return compiled

    @staticmethod
    def _compile(fn: Callable, example: tuple) -> Any:
        with torch.inference_mode():
            return unguarded(fn).aot_compile((example, {}))

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
