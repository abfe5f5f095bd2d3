"""Simulated GPUs with data: `cuda:0 … cuda:N-1` on a CPU-only host, backed by CPU memory.

Every multi-GPU mode must run whole requests (scheduler steps, decoding, numbers) before a
user's GPUs run it, and a lent machine has one GPU. `DIFFSHARD_SIMULATED_GPUS=2` (or `2x24GiB`)
makes `serve` and `plan` believe the host has two 24 GiB CUDA devices; tests enter `simulate()`.

How: a tensor on a simulated GPU is a `SimulatedTensor`, a wrapper whose `device` says `cuda:k`
and whose numbers are a CPU tensor. Its `__torch_function__` holds CUDA's rule that an op's
tensors share one device (0-dim CPU tensors pass as CUDA's scalars do; copies, `.to` and CPU
index tensors cross), raising CUDA's message, then runs the call on the CPU tensors and wraps
what it returns on the call's device. Calls that name a CUDA device without holding such a
tensor (`torch.zeros(..., device="cuda:1")`, a CPU tensor's `.to("cuda:0")`) go through a
`TorchFunctionMode` entered on every thread. The `torch.cuda` functions the code calls are
replaced while the simulation runs: each device has its own memory budget and allocation
counters (an allocation past the budget raises CUDA's out-of-memory error), each thread its own
current device, and the simulation counts device-wide synchronizations, host reads of device
values, and calls a thread makes on a device other than the one it set.

What it cannot show: speed (every op runs on the host's CPU, one after another: events time
wall clock), kernels' own numerics (CPU kernels, not cuBLAS or cuDNN), streams beyond the
default one, and generators (a `cuda` generator draws from the CPU's algorithm).
"""

from __future__ import annotations

import copy
import re
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from server.errors import DeviceError

ENV = "DIFFSHARD_SIMULATED_GPUS"
DEFAULT_MEMORY = 24 * 2**30
SAME_DEVICE = "Expected all tensors to be on the same device, but found at least two devices, {} and {}!"
_SPEC = re.compile(r"^\s*(\d+)\s*(?:[x×*]\s*(\S+))?\s*$")

_active: Simulation | None = None


@dataclass
class SimulatedGpu:
    index: int
    total: int
    allocated: int = 0
    peak: int = 0

    @property
    def name(self) -> str:
        return f"Simulated GPU {self.index} (CPU memory)"


@dataclass
class Simulation:
    """The simulated devices and what the code did with them."""

    gpus: list[SimulatedGpu]
    peer_access: bool = True  # what `torch.cuda.can_device_access_peer` answers
    syncs: list[tuple[int, str, str]] = field(default_factory=list)  # device, thread, caller
    reads: Counter[str] = field(default_factory=Counter)  # device values read on the host, by thread
    # calls on a device other than the thread's own: (thread, the call's device, the thread's)
    foreign: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    _storages: dict[int, list[int]] = field(default_factory=dict)  # storage → [gpu, bytes, wrappers]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gpu(self, device: torch.device | str | int | None) -> SimulatedGpu:
        index = _index(device)
        if not 0 <= index < len(self.gpus):
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (cuda:{index} of {len(self.gpus)} simulated)"
            )
        return self.gpus[index]

    def reset_counts(self) -> None:
        self.syncs.clear()
        self.reads.clear()
        self.foreign.clear()
        for gpu in self.gpus:
            gpu.peak = gpu.allocated

    # -- memory: a storage is counted once, however many wrappers view it ----------------------

    def wrap(self, data: torch.Tensor, device: torch.device) -> SimulatedTensor:
        gpu = self.gpu(device)
        key = data.untyped_storage()._cdata
        nbytes = data.untyped_storage().nbytes()
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                if gpu.allocated + nbytes > gpu.total:
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate {nbytes / 2**20:.2f} MiB. "
                        f"GPU {gpu.index} has a total capacity of {gpu.total / 2**30:.2f} GiB of which "
                        f"{(gpu.total - gpu.allocated) / 2**30:.2f} GiB is free (simulated)."
                    )
                entry = self._storages[key] = [gpu.index, nbytes, 0]
                gpu.allocated += nbytes
                gpu.peak = max(gpu.peak, gpu.allocated)
            entry[2] += 1
        wrapper = SimulatedTensor(data, torch.device("cuda", gpu.index))
        wrapper._counted = (self, key)  # released by `__del__`: a finalizer's weak reference would
        return wrapper  # refuse `swap_tensors`, which moving a module uses to keep its Parameters

    def holds(self, data: torch.Tensor) -> bool:
        """Whether `data`'s storage is a simulated GPU's (the CPU memory behind its tensors)."""
        return data.untyped_storage()._cdata in self._storages

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[2] -= 1
            if entry[2] == 0:
                del self._storages[key]
                self.gpus[entry[0]].allocated -= entry[1]

    # -- what threads do ------------------------------------------------------------------------

    def touched(self, device: torch.device) -> None:
        current = _thread.device if hasattr(_thread, "device") else 0
        if device.index != current:
            self.foreign[(threading.current_thread().name, str(device), f"cuda:{current}")] += 1

    def synchronized(self, device: Any = None) -> None:
        index = _thread.device if device is None and hasattr(_thread, "device") else _index(device)
        caller = traceback.extract_stack(limit=3)[0]
        self.syncs.append((index, threading.current_thread().name, f"{caller.filename}:{caller.lineno}"))


_thread = threading.local()


def _index(device: torch.device | str | int | None) -> int:
    if device is None:
        return getattr(_thread, "device", 0)
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return device.index if device.index is not None else getattr(_thread, "device", 0)


def active() -> Simulation | None:
    return _active


def parse_spec(text: str) -> tuple[int, int]:
    """`'2'` → (2, 24 GiB); `'4x80GiB'` → (4, 80 GiB)."""
    from server.engine.hardware.devices import parse_size  # which imports this module

    match = _SPEC.match(text)
    if not match or int(match[1]) < 1:
        raise DeviceError(
            f"{ENV}={text!r}: write a count, optionally with each device's memory, e.g. 2 or 2x24GiB"
        )
    return int(match[1]), parse_size(match[2]) if match[2] else DEFAULT_MEMORY


# -- the tensors -------------------------------------------------------------------------------


def _cuda(device: Any) -> torch.device | None:
    """The CUDA device `device` names (a bare `cuda` is the thread's current one), else None."""
    if isinstance(device, (str, torch.device)):
        device = torch.device(device)
        if device.type == "cuda":
            return torch.device("cuda", _index(device))
    return None


class SimulatedTensor(torch.Tensor):
    """A tensor on a simulated GPU: CUDA's device, the CPU's numbers (`_data`)."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: torch.device) -> SimulatedTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=device, requires_grad=False,
        )  # fmt: skip
        wrapper._data = data
        return wrapper

    def __del__(self) -> None:
        counted = self.__dict__.get("_counted")
        if counted is not None:
            counted[0]._release(counted[1])

    def __tensor_flatten__(self) -> tuple[list[str], torch.device]:
        # a traceable wrapper: `Module.to` swaps it into each Parameter (as CUDA's `param.data =`
        # keeps the Parameter object), so whoever holds a Parameter sees it moved
        return ["_data"], self.device

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], device: torch.device, size: Any, stride: Any
    ) -> SimulatedTensor:
        return _active.wrap(inner["_data"], device)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"{self._data!r} (simulated on {self.device})"

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return _call(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # Reached only by ops that bypass `__torch_function__` (C++ callers): the same rule.
        return _call(func, args, kwargs or {})


# Calls whose tensor arguments may sit on different devices, as on CUDA.
_CROSSING = {torch.Tensor.copy_, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}
# Calls that may take CPU index tensors with CUDA data.
_INDEXING = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.index_put,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put_.default,
    torch.ops.aten.index_put.default,
}
# Calls that read a device value on the host (each waits for the device: a sync).
_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__bool__, torch.Tensor.__index__,
}  # fmt: skip
_METADATA = {"shape", "dtype", "device", "ndim", "is_cuda", "is_cpu", "is_meta", "layout", "is_sparse",
             "is_quantized", "is_nested", "names", "is_leaf", "grad_fn", "requires_grad", "grad",
             "_is_view", "output_nr", "_version", "is_mkldnn", "is_mps", "is_xla", "is_xpu"}  # fmt: skip


def _call(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return _attribute(func, args, kwargs)
    if func in (torch.Tensor.dim, torch.Tensor.size, torch.Tensor.stride, torch.Tensor.numel,
                torch.Tensor.element_size, torch.Tensor.get_device, torch.Tensor.is_floating_point,
                torch.Tensor.is_complex, torch.Tensor.nelement, torch.Tensor.__len__,
                torch.Tensor.storage_offset, torch.Tensor.is_contiguous):  # fmt: skip
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func is torch._has_compatible_shallow_copy_type:
        return all(isinstance(t, SimulatedTensor) for t in args)  # never a wrapper's data into a plain tensor
    sim = _active
    if sim is None:
        raise RuntimeError("a tensor on a simulated GPU was used after the simulation ended")
    if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
        return _moved(sim, func, args, kwargs)
    if func is torch.Tensor.numpy or name == "__array__":
        raise TypeError(
            f"can't convert {args[0].device} device type tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )
    if func in (torch.Tensor.pin_memory,):
        return args[0]
    if func is torch.Tensor.is_pinned:
        return False
    if func is torch.Tensor.requires_grad_:
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.requires_grad_(*args, **kwargs)
    if func is torch.Tensor.__deepcopy__:
        return _deepcopy(sim, *args)
    if func is torch.Tensor.untyped_storage or func is torch.Tensor.data_ptr:
        return func(args[0]._data)
    target = _cuda(kwargs.get("device"))
    if "device" in kwargs and target is not None:
        kwargs = {**kwargs, "device": "cpu"}
    generator = kwargs.get("generator")
    if target is not None and isinstance(generator, torch.Generator) and generator.device.type != "cuda":
        raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{generator.device.type}'")
    devices: dict[str, torch.device] = {}
    inners: dict[int, torch.Tensor] = {}
    crossing = func in _CROSSING
    indexing = func in _INDEXING

    def unwrap(x: Any, position: int) -> Any:
        if isinstance(x, SimulatedTensor):
            if not (crossing and position > 0) and not indexing:
                devices.setdefault(str(x.device), x.device)
            inners[id(x._data)] = x
            return x._data
        cpu = isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0
        if cpu and not (crossing and position > 0) and not indexing:
            devices.setdefault("cpu", x.device)
        return x

    leaves, spec = tree_flatten((args, kwargs))
    if indexing:
        target = _indexed(sim, leaves)
    plain = [unwrap(x, i) for i, x in enumerate(leaves)]
    if target is None:
        if len(devices) > 1:
            first, second = sorted(devices)[:2]
            raise RuntimeError(SAME_DEVICE.format(*sorted((first, second), key=lambda d: d != "cpu")[::-1]))
        target = next((d for d in devices.values() if d.type == "cuda"), None)
    if func in _READS:
        sim.reads[threading.current_thread().name] += 1
    args, kwargs = tree_unflatten(plain, spec)
    with torch._C.DisableTorchFunction():
        out = func(*args, **kwargs)
    if target is None:
        return out
    if not _only_views(out, inners, name):
        sim.touched(target)  # a kernel ran there (a view of a peer's tensor runs none)
    return tree_map(lambda x: _rewrap(sim, x, target, inners), out)


def _only_views(out: Any, inners: dict[int, torch.Tensor], name: str) -> bool:
    """Whether a call only made views of its inputs (metadata: no kernel on a GPU)."""
    if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__":
        return False  # wrote into an input
    storages = {t._data.untyped_storage()._cdata for t in inners.values()}
    results = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    return bool(results) and all(x.untyped_storage()._cdata in storages for x in results)


def _indexed(sim: Simulation, leaves: list[Any]) -> torch.device | None:
    """Indexing's rule: index tensors on the CPU or the indexed tensor's device; a 0-dim integer
    index on a GPU is read on the host (a sync), wherever the indexed tensor is."""
    here = leaves[0].device
    for x in leaves[1:]:
        if not isinstance(x, torch.Tensor) or x.device.type == "cpu" or x.device == here:
            continue
        if x.dim() == 0 and not x.is_floating_point():
            sim.reads[threading.current_thread().name] += 1
            continue
        raise RuntimeError(
            f"indices should be either on cpu or on the same device as the indexed tensor ({here})"
        )
    return here if here.type == "cuda" else None


def _rewrap(sim: Simulation, x: Any, device: torch.device, inners: dict[int, torch.Tensor]) -> Any:
    if not isinstance(x, torch.Tensor) or isinstance(x, SimulatedTensor):
        return x
    same = inners.get(id(x))
    if same is not None and same.device == device:
        return same  # an in-place call returns its own tensor
    return sim.wrap(x, device)


def _attribute(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    owner = getattr(func, "__self__", None)
    name = getattr(owner, "__name__", "")
    if name == "data" and func.__name__ == "__get__":
        self = args[0]
        return _active.wrap(self._data.detach(), self.device) if _active else self
    if name == "data":
        raise NotImplementedError("assigning `.data` of a tensor on a simulated GPU")
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _moved(sim: Simulation, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`.to(...)`, `.cuda()`, `.cpu()`: a copy onto the device named (none if already there)."""
    self, rest = args[0], list(args[1:])
    device: torch.device | None = None
    dtype = kwargs.pop("dtype", None)
    copy_ = kwargs.pop("copy", False)
    kwargs.pop("non_blocking", None)
    memory_format = kwargs.pop("memory_format", torch.preserve_format)
    if func is torch.Tensor.cpu:
        device = torch.device("cpu")
    elif func is torch.Tensor.cuda:
        given = rest[0] if rest else kwargs.pop("device", None)
        device = torch.device("cuda", _index(given))
    else:
        given = kwargs.pop("device", None)
        for arg in rest:
            if isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, torch.Tensor):
                device, dtype = arg.device, arg.dtype
            elif isinstance(arg, (str, torch.device, int)) and not isinstance(arg, bool):
                given = arg
            elif isinstance(arg, bool) and rest.index(arg) >= 1:
                pass  # non_blocking, copy: a copy is always made across devices
        if given is not None:
            device = torch.device(given) if not isinstance(given, int) else torch.device("cuda", given)
    current = self.device
    if device is None:
        device = current
    elif device.type == "cuda":
        device = torch.device("cuda", _index(device))
    dtype = dtype or self.dtype
    data = self._data if isinstance(self, SimulatedTensor) else self
    if device == current and dtype == self.dtype and not copy_:
        return self
    with torch._C.DisableTorchFunction():
        moved = data.to(dtype=dtype, memory_format=memory_format, copy=True)
    if device.type == "cuda":
        sim.touched(device)  # a copy from a peer runs on the destination's stream
        return sim.wrap(moved, device)
    return moved


def _deepcopy(sim: Simulation, self: SimulatedTensor, memo: dict) -> SimulatedTensor:
    if id(self) in memo:
        return memo[id(self)]
    with torch._C.DisableTorchFunction():
        data = self._data.clone()
    new = sim.wrap(data, self.device)
    for key, value in self.__dict__.items():
        if key not in ("_data", "_counted"):
            setattr(new, key, copy.deepcopy(value, memo))
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.requires_grad_(new, self.requires_grad)
    memo[id(self)] = new
    return new


class _NamesCuda(TorchFunctionMode):
    """Calls that name a CUDA device without holding a simulated tensor (factories, a CPU
    tensor's `.to("cuda:0")`): run on the CPU and wrapped on that device."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _active is not None and any(t is SimulatedTensor for t in types):
            return _call(func, args, kwargs)
        if _active is not None and _names_cuda(func, args, kwargs):
            if func in (torch.Tensor.to, torch.Tensor.cuda):
                return _moved(_active, func, args, dict(kwargs))
            if func is torch.Tensor.pin_memory:
                return args[0]
            return _call(func, args, dict(kwargs))
        if func is torch.Tensor.pin_memory and _active is not None:
            return args[0]  # pinned host memory needs a real CUDA driver: plain host memory here
        if _active is not None and kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


def _names_cuda(func: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    if func is torch.Tensor.cuda:
        return True
    if _cuda(kwargs.get("device")) is not None:
        return True
    if func is torch.Tensor.to:
        return any(_cuda(a) is not None or (isinstance(a, int) and not isinstance(a, bool)) for a in args[1:])
    return False


# -- torch.cuda while simulating -----------------------------------------------------------------


class _Device:
    """`torch.cuda.device(d)`: this thread's current device while inside."""

    def __init__(self, device: Any) -> None:
        self.index = _index(device) if device is not None and device != -1 else None

    def __enter__(self) -> None:
        self.before = getattr(_thread, "device", 0)
        if self.index is not None:
            _thread.device = self.index

    def __exit__(self, *exc: object) -> None:
        _thread.device = self.before


class _Event:
    """A CUDA event: on simulated GPUs every op has finished when it returns, so an event's
    time is the host's clock when it is recorded."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("CUDA error: device not ready (an event not recorded)")
        return (end.time - self.time) * 1000.0


@dataclass(frozen=True)
class _Stream:
    device: torch.device
    default: bool = True

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: _Stream) -> None:
        pass

    def wait_event(self, event: _Event) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record()
        return event


def _cuda_functions(sim: Simulation) -> dict[str, Any]:
    def properties(device: Any = None) -> SimpleNamespace:
        gpu = sim.gpu(device)
        return SimpleNamespace(
            name=gpu.name, total_memory=gpu.total, major=9, minor=0, multi_processor_count=132,
            uuid=f"simulated-{gpu.index}", is_integrated=False,
        )  # fmt: skip

    def set_device(device: Any) -> None:
        _thread.device = _index(device)

    def stream_of(device: Any = None) -> _Stream:
        return _Stream(torch.device("cuda", _index(device)))

    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "device_count": lambda: len(sim.gpus),
        "current_device": lambda: getattr(_thread, "device", 0),
        "set_device": set_device,
        "device": _Device,
        "synchronize": sim.synchronized,
        "mem_get_info": lambda device=None: (
            sim.gpu(device).total - sim.gpu(device).allocated,
            sim.gpu(device).total,
        ),
        "memory_allocated": lambda device=None: sim.gpu(device).allocated,
        "memory_reserved": lambda device=None: sim.gpu(device).allocated,
        "max_memory_allocated": lambda device=None: sim.gpu(device).peak,
        "reset_peak_memory_stats": lambda device=None: setattr(
            sim.gpu(device), "peak", sim.gpu(device).allocated
        ),
        "empty_cache": lambda: None,
        "get_device_name": lambda device=None: sim.gpu(device).name,
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_properties": properties,
        "is_bf16_supported": lambda including_emulation=True: True,
        "can_device_access_peer": lambda device, peer: sim.peer_access,
        "Event": _Event,
        "current_stream": stream_of,
        "default_stream": stream_of,
        "stream": lambda stream=None: _Device(stream.device if stream is not None else None),
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
    }


_saved: dict[str, Any] = {}
_bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]
_entered = threading.local()


def _enter_mode() -> None:
    if not getattr(_entered, "mode", None):
        _entered.mode = _NamesCuda()
        _entered.mode.__enter__()


def _bootstrap_with_mode(self: threading.Thread) -> None:
    _enter_mode()
    _bootstrap(self)


def install(count: int, memory: int = DEFAULT_MEMORY, *, peer_access: bool = True) -> Simulation:
    """Simulate `count` GPUs of `memory` bytes each in this process, until `uninstall()`."""
    global _active
    if _active is not None:
        raise RuntimeError("GPUs are already simulated in this process")
    if torch.cuda.is_available():
        raise DeviceError(
            f"{ENV} is for hosts without CUDA: this host has {torch.cuda.device_count()} GPU(s)"
        )
    sim = Simulation([SimulatedGpu(i, memory) for i in range(count)], peer_access=peer_access)
    for name, replacement in _cuda_functions(sim).items():
        _saved[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, replacement)
    threading.Thread._bootstrap_inner = _bootstrap_with_mode  # type: ignore[attr-defined]
    _enter_mode()
    _active = sim
    return sim


def uninstall() -> None:
    """Back to this host's own devices; tensors left on the simulated ones may no longer be used."""
    global _active
    _active = None
    threading.Thread._bootstrap_inner = _bootstrap  # type: ignore[attr-defined]
    for name, original in _saved.items():
        if original is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)
    _saved.clear()
    mode = getattr(_entered, "mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)
        _entered.mode = None


@contextmanager
def simulate(count: int, memory: int = DEFAULT_MEMORY, *, peer_access: bool = True) -> Iterator[Simulation]:
    sim = install(count, memory, peer_access=peer_access)
    try:
        yield sim
    finally:
        uninstall()


def install_from_environment(environ: dict[str, str]) -> Simulation | None:
    """`DIFFSHARD_SIMULATED_GPUS=N` or `NxSIZE`: simulate, saying so loudly on stderr."""
    text = environ.get(ENV, "").strip()
    if not text:
        return None
    count, memory = parse_spec(text)
    sim = install(count, memory)
    print(
        f"diffshard: {ENV}={text}: simulating {count} CUDA device(s) of {memory / 2**30:g} GiB in CPU memory "
        "(for trying multi-GPU plans; nothing runs on a GPU)",
        file=sys.stderr,
    )
    return sim
