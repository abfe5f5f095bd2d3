"""Bytes a computation holds at its peak, counted by running it on the meta device: every storage
an op makes is counted from that op until the last tensor on it is gone, as Python frees them.
For code too branchy to count by hand (Wan's causal 3D VAE, with its per-convolution caches).

What it leaves out: the weights and inputs made before it runs, and what kernels allocate for
themselves (workspaces, oneDNN's reorders on a CPU: measured 8-10% over this count for Wan's VAE).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """While entered: `live` bytes made by ops and not yet freed, and their `peak`."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._holders: dict[int, list[int]] = {}  # a storage → [its bytes, tensors alive on it]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._hold(tensor)
        return out

    def _hold(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        holder = self._holders.get(key)
        if holder is None:
            holder = self._holders[key] = [storage.nbytes(), 0]
            self.live += holder[0]
            self.peak = max(self.peak, self.live)
        holder[1] += 1
        weakref.finalize(tensor, self._drop, key)

    def _drop(self, key: int) -> None:
        holder = self._holders.get(key)
        if holder is not None:
            holder[1] -= 1
            if holder[1] == 0:
                self.live -= holder[0]
                del self._holders[key]


def peak_bytes(run: Callable[[], object]) -> int:
    """The peak bytes `run` holds (its result dropped at the end), run on meta tensors it makes."""
    with torch.inference_mode(), LiveBytes() as counter:
        result = run()
        del result
    return counter.peak
