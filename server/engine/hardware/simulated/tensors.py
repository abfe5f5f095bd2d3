"""Tensors on simulated GPUs: CUDA's device, the CPU's numbers, CUDA's rules on which devices
an op's tensors may sit (`simulated/__init__.py` says how)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from server.engine.hardware.simulated.gpus import Simulation, active, device_index

PINNED = "_simulated_pinned"  # set on a host tensor `pin_memory` made (plain host memory here)
_UPLOADS = (torch.tensor, torch.as_tensor, torch.asarray)  # host data made a GPU tensor: a blocking copy
SAME_DEVICE = "Expected all tensors to be on the same device, but found at least two devices, {} and {}!"


def _cuda(device: Any) -> torch.device | None:
    """The CUDA device `device` names (a bare `cuda` is the thread's current one), else None."""
    if isinstance(device, (str, torch.device)):
        device = torch.device(device)
        if device.type == "cuda":
            return torch.device("cuda", device_index(device))
    return None


def wrap(sim: Simulation, data: torch.Tensor, device: torch.device) -> SimulatedTensor:
    """`data` (a CPU tensor) as a tensor on simulated GPU `device`, its storage counted there."""
    device = torch.device("cuda", sim.gpu(device).index)
    wrapper = SimulatedTensor(data, device)
    wrapper._counted = (sim, sim.allocate(data, device))  # released by `__del__`: a finalizer's
    return wrapper  # weak reference would refuse `swap_tensors`, which `Module.to` uses


class SimulatedTensor(torch.Tensor):
    """A tensor on a simulated GPU: CUDA's device, the CPU's numbers (`_data`)."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: torch.device) -> SimulatedTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=device,
            requires_grad=False,
        )
        wrapper._data = data
        return wrapper

    def __del__(self) -> None:
        counted = self.__dict__.get("_counted")
        if counted is not None:
            counted[0].release(counted[1])

    def __tensor_flatten__(self) -> tuple[list[str], torch.device]:
        # a traceable wrapper: `Module.to` swaps it into each Parameter (as CUDA's `param.data =`
        # keeps the Parameter object), so whoever holds a Parameter sees it moved
        return ["_data"], self.device

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], device: torch.device, size: Any, stride: Any
    ) -> SimulatedTensor:
        return wrap(active(), inner["_data"], device)

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
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}
_METADATA = {
    "shape",
    "dtype",
    "device",
    "ndim",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "layout",
    "is_sparse",
    "is_quantized",
    "is_nested",
    "names",
    "is_leaf",
    "grad_fn",
    "requires_grad",
    "grad",
    "_is_view",
    "output_nr",
    "_version",
    "is_mkldnn",
    "is_mps",
    "is_xla",
    "is_xpu",
}


def _call(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return _attribute(func, args, kwargs)
    if func in (
        torch.Tensor.dim,
        torch.Tensor.size,
        torch.Tensor.stride,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.get_device,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.nelement,
        torch.Tensor.__len__,
        torch.Tensor.storage_offset,
        torch.Tensor.is_contiguous,
    ):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func is torch._has_compatible_shallow_copy_type:
        return all(isinstance(t, SimulatedTensor) for t in args)  # never a wrapper's data into a plain tensor
    sim = active()
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
        if func in _UPLOADS and not (args and isinstance(args[0], SimulatedTensor)):
            sim.uploads[threading.current_thread().name] += 1
    generator = kwargs.get("generator")
    if target is not None and isinstance(generator, torch.Generator) and generator.device.type != "cuda":
        raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{generator.device.type}'")
    devices: dict[str, torch.device] = {}
    inners: dict[int, torch.Tensor] = {}
    devices_seen: set[torch.device] = set()  # every simulated tensor's, crossing or not
    crossing = func in _CROSSING
    indexing = func in _INDEXING

    def unwrap(x: Any, position: int) -> Any:
        if isinstance(x, SimulatedTensor):
            devices_seen.add(x.device)
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
    if not _only_views(out, inners, name) and not (crossing and len(devices_seen) > 1):
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
    return wrap(sim, x, device)


def _attribute(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    owner = getattr(func, "__self__", None)
    name = getattr(owner, "__name__", "")
    if name == "data" and func.__name__ == "__get__":
        self = args[0]
        sim = active()
        return wrap(sim, self._data.detach(), self.device) if sim else self
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
    non_blocking = kwargs.pop("non_blocking", False)
    memory_format = kwargs.pop("memory_format", torch.preserve_format)
    if func is torch.Tensor.cpu:
        device = torch.device("cpu")
    elif func is torch.Tensor.cuda:
        given = rest[0] if rest else kwargs.pop("device", None)
        device = torch.device("cuda", device_index(given))
    else:
        given = kwargs.pop("device", None)
        flags = [arg for arg in rest if isinstance(arg, bool)]  # non_blocking, then copy (made anyway)
        non_blocking = non_blocking or bool(flags and flags[0])
        for arg in rest:
            if isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, torch.Tensor):
                device, dtype = arg.device, arg.dtype
            elif isinstance(arg, (str, torch.device, int)) and not isinstance(arg, bool):
                given = arg
        if given is not None:
            device = torch.device(given) if not isinstance(given, int) else torch.device("cuda", given)
    current = self.device
    if device is None:
        device = current
    elif device.type == "cuda":
        device = torch.device("cuda", device_index(device))
    dtype = dtype or self.dtype
    data = self._data if isinstance(self, SimulatedTensor) else self
    if device == current and dtype == self.dtype and not copy_:
        return self
    with torch._C.DisableTorchFunction():
        moved = data.to(dtype=dtype, memory_format=memory_format, copy=True)
    if device.type == "cuda":
        if current.type == "cpu" and not (non_blocking and getattr(data, PINNED, False)):
            sim.uploads[threading.current_thread().name] += 1
        if current == device:
            sim.touched(device)  # a conversion on the device; a copy between devices is guarded by
            # PyTorch itself (it runs on the source's stream): no device of the thread's to set
        return wrap(sim, moved, device)
    return moved


def _deepcopy(sim: Simulation, self: SimulatedTensor, memo: dict) -> SimulatedTensor:
    if id(self) in memo:
        return memo[id(self)]
    with torch._C.DisableTorchFunction():
        data = self._data.clone()
    new = wrap(sim, data, self.device)
    for key, value in self.__dict__.items():
        if key not in ("_data", "_counted"):
            setattr(new, key, copy.deepcopy(value, memo))
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.requires_grad_(new, self.requires_grad)
    memo[id(self)] = new
    return new


class NamesCuda(TorchFunctionMode):
    """Calls that name a CUDA device without holding a simulated tensor (factories, a CPU
    tensor's `.to("cuda:0")`): run on the CPU and wrapped on that device."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        sim = active()
        if sim is not None and any(t is SimulatedTensor for t in types):
            return _call(func, args, kwargs)
        if sim is not None and _names_cuda(func, args, kwargs):
            if func in (torch.Tensor.to, torch.Tensor.cuda):
                return _moved(sim, func, args, dict(kwargs))
            if func is torch.Tensor.pin_memory:
                return _pinned(args[0])
            return _call(func, args, dict(kwargs))
        if sim is None:
            return func(*args, **kwargs)
        # pinned host memory needs a real CUDA driver: plain host memory here, marked as pinned
        if func is torch.Tensor.pin_memory:
            return _pinned(args[0])
        if func is torch.Tensor.is_pinned:
            return getattr(args[0], PINNED, False)
        if kwargs.get("pin_memory"):
            return _pinned(func(*args, **{**kwargs, "pin_memory": False}))
        return func(*args, **kwargs)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        pinned = tensor.detach()
    setattr(pinned, PINNED, True)
    return pinned


def _names_cuda(func: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    if func is torch.Tensor.cuda:
        return True
    if _cuda(kwargs.get("device")) is not None:
        return True
    if func is torch.Tensor.to:
        return any(_cuda(a) is not None or (isinstance(a, int) and not isinstance(a, bool)) for a in args[1:])
    return False
