"""Frozen CPU graphs kept whole on disk, so a restart loads them instead of compiling again.

A frozen graph folds its model's weights in, prepacked for oneDNN; inductor's graph cache cannot
keep those (oneDNN's tensors do not pickle) and torch 2.13's `aot_compile` cannot freeze.
AOTInductor can: the function is exported (`torch.export`, the model's weights lifted from the
module holding it), compiled with freezing, and its prepacked weights written into a shared
library, in a process forked for it (`_forked`: the server keeps its GIL). An SD-1.5-width
UNet's bf16 2-row bucket at a 32² latent, on a 2-core AVX-512 host:
compiled in 74 s, loaded in 1.6 s, 0.55 s a call (frozen just in time: 0.53 s a call, and
45–80 s to compile again at every start).

The library is called through AOTInductor's C interface (`aoti_runtime/interface.h`) by ctypes,
which lets go of the GIL for the call: torch's own runner holds it throughout (two replicas'
calls ran one after the other, and the event loop stalled beside them).

A library holds its weights, so it is kept by what the weights are (`fingerprint`), never by
where they live; beside it, a JSON file with its attention kernels (measured per shape when it
was built) and its output's structure."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch._inductor import aot_compile
from torch._inductor import config as inductor_config
from torch.utils._pytree import tree_leaves, tree_map, tree_unflatten, treespec_dumps, treespec_loads

from server.engine.runtime.tracing import trace_gate

log = logging.getLogger("diffshard")

SUFFIX = ".so"
CALLERS = 4  # calls one library runs at once (each its own activations; the weights are shared)
KEPT_BYTES = 16 * 2**30  # of libraries in one cache directory (`--compiled-bytes`'s default)
STALE_BUILD_S = 3600  # a build's folder older than this was left by a start that died
BUILD_LIMIT_S = 1800  # a build's process running longer is killed (the graph is frozen just in time)
POLL_S = 0.1  # how often a build's end is looked for
_opens = itertools.count()

_PR_SET_PDEATHSIG = 1  # prctl's: a signal this process gets when its parent dies
_pointer_of = ctypes.pythonapi.PyCapsule_GetPointer
_pointer_of.restype, _pointer_of.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_of = ctypes.pythonapi.PyCapsule_New
_capsule_of.restype = ctypes.py_object
_capsule_of.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Library:
    """One frozen graph's shared library, called as the function it was built from (tensors in
    the order export flattened them; every other input was fixed when it was built)."""

    def __init__(self, path: Path, out_spec: Any, callers: int = CALLERS) -> None:
        self._lib = _opened(path)
        self._container = ctypes.c_void_p()
        made = self._lib.AOTInductorModelContainerCreateWithDevice(
            ctypes.byref(self._container), ctypes.c_size_t(callers), b"cpu", None
        )
        _check(made, "load")
        outputs = ctypes.c_size_t()
        _check(
            self._lib.AOTInductorModelContainerGetNumOutputs(self._container, ctypes.byref(outputs)), "load"
        )
        self._outputs, self._out_spec = outputs.value, out_spec

    def __call__(self, *args: Any) -> Any:
        tensors = [leaf for leaf in tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        # new handles to the inputs, which the call steals; its outputs' handles are ours to steal
        handles = [_pointer_of(h, None) for h in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)]
        inputs = (ctypes.c_void_p * len(handles))(*handles)
        outputs = (ctypes.c_void_p * self._outputs)()
        count, out_count = ctypes.c_size_t(len(handles)), ctypes.c_size_t(self._outputs)
        ran = self._lib.AOTInductorModelContainerRun(
            self._container, inputs, count, outputs, out_count, None, None
        )
        _check(ran, "call")
        owned = [_capsule_of(handle, None, None) for handle in outputs]
        return tree_unflatten(torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(owned), self._out_spec)

    def __del__(self) -> None:
        if getattr(self, "_container", None) and self._container.value:
            self._lib.AOTInductorModelContainerDelete(self._container)


def _opened(path: Path) -> ctypes.CDLL:
    """The library at `path`, opened under a name of its own: the dynamic loader hands back any
    library already open under the same name, even where the file was replaced since (a rebuilt
    one). CDLL, not PyDLL: each call lets go of the GIL."""
    alias = path.with_name(f".{path.stem}-{os.getpid()}-{next(_opens)}{SUFFIX}")
    try:
        os.link(path, alias)
    except OSError:  # a filesystem without hard links
        return ctypes.CDLL(str(path))
    try:
        return ctypes.CDLL(str(alias))
    finally:
        alias.unlink(missing_ok=True)  # the open library keeps its file


def _check(error: int, what: str) -> None:
    if error:  # AOTInductor printed its exception on stderr
        raise RuntimeError(f"a frozen graph's library failed to {what} (AOTInductor error {error})")


class _Holding(nn.Module):
    """`fn` as a module that holds `model`: export lifts the model's weights, freezing folds them."""

    def __init__(self, fn: Callable[..., Any], model: nn.Module) -> None:
        super().__init__()
        self.fn, self.model = fn, model

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _cloned(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(model: nn.Module) -> str | None:
    """A digest of every weight's name, dtype, shape and bytes (~0.5 s a GB), or None for weights
    whose bytes cannot be read plainly (a quantized tensor subclass: those never freeze)."""
    digest = hashlib.sha256()
    try:
        for name, tensor in sorted(model.state_dict(keep_vars=False).items()):
            data = tensor.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{name} {data.dtype} {tuple(tensor.shape)}".encode())
            digest.update(data.view(torch.uint8).numpy().data)
    except (RuntimeError, TypeError, ValueError):
        return None
    return digest.hexdigest()


def build(
    path: Path,
    fn: Callable[..., Any],
    model: nn.Module,
    example: tuple,
    kernels: list[str],
    checkpoint: Callable[[], None] = lambda: None,
) -> tuple[Library, list[str]] | None:
    """`fn(*example)` (holding `model`) compiled with freezing into a library at `path`, loaded;
    None where export or AOTInductor refuses it or its build runs too long (said: the caller
    freezes just in time). Built in a process forked from this one (`_forked`); `checkpoint` is
    called while this thread waits for it, and what it raises (a compile told to stop) ends the
    build. A build ended by a signal (the OOM killer's, a compiler's crash) raises: freezing the
    same just in time, here, could end this process the same way."""
    try:
        # the build's folder is this process's: removed however the build ends (stopped, killed)
        with tempfile.TemporaryDirectory(prefix=".building-", dir=path.parent) as work:
            code = _forked(partial(_write, path, Path(work), fn, model, example, kernels), checkpoint)
        if code == 0:
            return _opened_library(path, json.loads(path.with_suffix(".json").read_text()))
    except Exception as err:
        _cannot_keep(model, err)
        return None
    if code < 0:  # else the build said why itself
        raise RuntimeError(f"its build was ended by signal {-code}")
    return None


def _write(
    path: Path, work: Path, fn: Callable[..., Any], model: nn.Module, example: tuple, kernels: list[str]
) -> bool:
    """`build`'s work, in the folder `work`: the library and its JSON written at `path`; False
    where refused (said)."""
    try:
        # Export runs outside inference mode (it refuses inference tensors: the warm-up's are
        # cloned), and under the trace gate: it swaps the model's weights for traced ones
        # while it traces, which a step loop's eager call must never see (where this runs in
        # the serving process). Freezing applies only where gradients are off (inductor's
        # compile_fx reads it).
        with torch.inference_mode(False), torch.no_grad():
            with trace_gate().trace():
                program = torch.export.export(_Holding(fn, model), tree_map(_cloned, example), strict=False)
            # the shared library alone, where this build's folder is: a package (.pt2) copied
            # its bytes into an archive, then out again
            built = work / f"graph{SUFFIX}"
            options = {"freezing": True, "aot_inductor.output_path": str(built)}
            args, kwargs = program.example_inputs
            aot_compile(program.module(check_guards=False), args, kwargs, options=options)
        about = {
            "attention": kernels,
            "out_spec": treespec_dumps(program.call_spec.out_spec),
            "sha256": _digest(built),
        }
        path.with_suffix(".json").write_text(json.dumps(about))
        built.replace(path)  # last: a library on disk always has its JSON
        return True
    except Exception as err:  # export's and inductor's refusals have no common class
        _cannot_keep(model, err)
        return False


def _cannot_keep(model: nn.Module, err: Exception) -> None:
    log.warning(
        "cannot keep %s's frozen graph (%s: %s): it is frozen just in time, at every start",
        type(model).__name__,
        type(err).__name__,
        str(err).splitlines()[0] if str(err) else "",
    )


def _forked(work: Callable[[], bool], checkpoint: Callable[[], None]) -> int:
    """`work()` in a child process forked from this one: its exit code (0 where it returned True;
    negative: the signal that ended it). Where there is no fork (not Linux), here.

    A build in this process held the GIL for seconds at a time while inductor copied the frozen
    weights (an SD-1.5-width UNet's 1.7 GB: three stalls of 3.4-4.7 s each, the API's event loop
    and the step loops stopped, a keep-alive connection reset), and its tracing slowed the step
    loops throughout. The child shares the model's pages (copied only where written) and leaves
    this process the GIL: the longest stall beside a build became 56 ms."""
    if sys.platform != "linux":
        return 0 if work() else 1
    parent = os.getpid()
    with trace_gate().held_whole(), warnings.catch_warnings():
        # Python 3.12 warns of any fork beside threads: the child runs `work` alone and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
        if pid == 0:
            _child(work, parent)
    deadline = time.monotonic() + BUILD_LIMIT_S
    try:
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"its build ran past {BUILD_LIMIT_S} s")
            checkpoint()
            time.sleep(POLL_S)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return os.waitstatus_to_exitcode(ended[1])


def _child(work: Callable[[], bool], parent: int) -> NoReturn:
    """A forked child: `work()` alone, then exit (never the parent's exit handlers)."""
    code = 1
    try:
        sys.settrace(None)  # a hook that gives way (`GiveWay`), called at every frame: the parent's
        # killed with its parent, never left building; unless the parent died before that was set
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            return
        with contextlib.suppress(OSError):  # short of memory, the kernel ends the build, not the server
            Path("/proc/self/oom_score_adj").write_text("1000")
        # inductor writes the callers' intra-op threads into its kernels; what runs here runs on
        # one: OpenMP's threads and inductor's compile workers are the parent's, absent here
        inductor_config.cpp.threads = torch.get_num_threads()
        inductor_config.compile_threads = 1
        torch.set_num_threads(1)
        code = 0 if work() else 1
    finally:
        os._exit(code)


def prune(folder: Path, in_use: set[Path], kept_bytes: int = KEPT_BYTES) -> None:
    """Bound the libraries kept in `folder` to `kept_bytes`: those used least recently go first
    (`load` touches a library), never one this process has open (another process that has one
    open keeps it until it exits); and the folders of builds a dead start left behind. Files
    another process removes meanwhile are passed over."""
    found = []
    for library in folder.glob(f"[!.]*{SUFFIX}"):  # not a library being opened (`_opened`)
        with contextlib.suppress(OSError):
            stat = library.stat()
            found.append((stat.st_mtime, stat.st_size, library))
    kept = 0
    for _, size, library in sorted(found, key=lambda each: each[0], reverse=True):
        if kept + size <= kept_bytes or library in in_use:
            kept += size
            continue
        log.info("frozen graph %s removed: --compiled-bytes %d keeps no more", library, kept_bytes)
        library.unlink(missing_ok=True)
        library.with_suffix(".json").unlink(missing_ok=True)
    for building in folder.glob(".building-*"):
        with contextlib.suppress(OSError):
            if time.time() - building.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(building, ignore_errors=True)


def load(path: Path) -> tuple[Library, list[str]] | None:
    """The library at `path` and its attention kernels, or None where there is none or it cannot
    be loaded (another torch, a truncated file: said, and built again)."""
    if not path.is_file():
        return None
    try:
        about = json.loads(path.with_suffix(".json").read_text())
        # a damaged library must never be opened: loading one cut short crashed the process
        if _digest(path) != about["sha256"]:
            raise ValueError("its bytes are not those built")
        return _opened_library(path, about)
    except Exception as err:
        log.warning("frozen graph %s is unusable (%s: %s); compiling again", path, type(err).__name__, err)
        return None


def _opened_library(path: Path, about: dict[str, Any]) -> tuple[Library, list[str]]:
    """The library at `path`, its bytes those `about` (its JSON) describes, and its kernels."""
    library = Library(path, treespec_loads(about["out_spec"]))
    os.utime(path)  # used now: the last to go when the folder is pruned
    return library, list(about["attention"])
