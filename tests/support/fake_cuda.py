"""A fake CUDA for the fake-GPU harness: the boundary where no GPU exists (said where used)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten


def _view(t: torch.Tensor, index: Any) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """`t[index]`'s basic part (ints, slices, None, ...) as aten views, and its tensor indices."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        used = sum(i is not None and i is not Ellipsis for i in index)
        index = index[:at] + (slice(None),) * (t.dim() - used) + index[at + 1 :]
    dim, advanced = 0, []
    for i in index:
        if i is None:
            t, dim = aten.unsqueeze.default(t, dim), dim + 1
        elif isinstance(i, slice):
            t, dim = aten.slice.Tensor(t, dim, i.start, i.stop, i.step or 1), dim + 1
        elif isinstance(i, int):
            t = aten.select.int(t, dim, i)
        elif isinstance(i, torch.Tensor):
            advanced.append((dim, i))
            dim += 1
        else:
            raise NotImplementedError(f"fake-GPU indexing by {i!r}")
    return t, advanced


def _on_cuda(x: Any) -> bool:
    if isinstance(x, FakeTensor):
        return True
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return isinstance(x, str) and x.startswith("cuda")


class NoEvent:
    """`torch.cuda.Event` where nothing runs: recorded, never waited for (as a CPU build, waiting
    raises: where a GPU's asynchronous error would surface)."""

    def __init__(self, **options: bool) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        raise RuntimeError("waiting for a CUDA event: no CUDA here (fake GPUs run nothing)")


class FakeCuda(TorchFunctionMode):
    """Fake CUDA devices on a CPU build: calls touching them run under a `FakeTensorMode`."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        # a thread's current CUDA device, which the walk and helper threads set, and the events
        # a walk records as it leaves a stage (a CPU build raises on these): one device for every
        # thread, events that mark nothing; waits and syncs still raise
        self._device = mock.patch.multiple(
            torch.cuda,
            current_device=lambda: 0,
            set_device=lambda device: None,
            device=lambda device: contextlib.nullcontext(),
            Event=NoEvent,
        )

    def __enter__(self) -> FakeCuda:
        self._device.start()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._device.stop()

    def tensor(self, t: torch.Tensor, device: str) -> FakeTensor:
        """A fake of `t`'s shape and dtype on `device` (from its meta twin: no data)."""
        return FakeTensor(self.fake, t.detach().to("meta"), torch.device(device))

    def _faked(self, x: Any) -> Any:
        # real CPU tensors meeting a fake become fake CPU tensors (same device, so a mix still raises)
        return (
            self.fake.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
        )

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("pin_memory"):  # pinned host memory needs a CUDA build: plain host memory
            kwargs = {**kwargs, "pin_memory": False}
        if not any(_on_cuda(x) for x in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)  # CPU work runs for real
        args, kwargs = tree_map(self._faked, (args, kwargs))
        with self.fake:
            if func is torch.Tensor.__getitem__:
                view, advanced = _view(*args)
                if not advanced:
                    return view
                indices: list[torch.Tensor | None] = [None] * (advanced[-1][0] + 1)
                for dim, i in advanced:
                    indices[dim] = i
                return aten.index.Tensor(view, indices)
            if func is torch.Tensor.__setitem__:
                t, index, value = args
                view, advanced = _view(t, index)
                if advanced:
                    raise NotImplementedError("fake-GPU assignment by a tensor index")
                if isinstance(value, torch.Tensor):
                    aten.copy_.default(view, value)
                else:
                    aten.fill_.Scalar(view, value)
                return None
            if func is torch.Tensor.copy_:
                return aten.copy_.default(*args, **kwargs)
            if func is torch.Tensor.contiguous:
                t = args[0]
                return (
                    t if t.is_contiguous() else aten.clone.default(t, memory_format=torch.contiguous_format)
                )
            return func(*args, **kwargs)
