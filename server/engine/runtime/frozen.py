"""Frozen graphs of one model on a CPU: inductor's freezing folds the weights into the graph as
constants, prepacked for oneDNN, which is where a compiled convolution network gains on a CPU
(the SD-1.5 UNet's bf16 2-row call: 0.54 s frozen, 0.75 s eager, and no faster than eager with
its weights as graph inputs, on a 2-core AVX-512 host).

Each frozen graph holds its own prepacked copy of the weights, so a model's frozen graphs are
bounded (`freeze_budget`); the buckets warmed first freeze first, the rest compile unfrozen. A
frozen graph is a function holding its model (`own_code`), kept in the cache directory as an
AOTInductor library that the next start loads (`packages.py`), or, on the jit route or without a
cache directory, compiled just in time at every start. Its attention runs by the kernel measured
faster for each of its shapes (`cpu_attention.py`). Adapters' hooks never reach it: rows with
adapters run eagerly on the model's own weights, which nothing here changes in place."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from server.engine.denoisers.blocks import tensor_bytes
from server.engine.runtime import packages
from server.engine.runtime.cpu_attention import choose_kernels, routed
from server.engine.runtime.graphs import GraphStore, own_code

log = logging.getLogger("diffshard")

FREEZE_FLOOR = 512 * 2**20  # a small model's frozen buckets all fit
FROZEN_COPIES = 2  # a large one's: the weights' bytes twice over (a lone image at two sizes)


def freeze_budget(model: nn.Module, devices: Sequence[str], whole: bool) -> int:
    """Bytes of frozen copies of `model`'s weights its graphs may hold: 0 where nothing freezes
    (a GPU, whose graphs gain without; graphs of a block, which take the module as an argument)."""
    if not whole or any(d != "cpu" for d in devices):
        return 0
    return max(FREEZE_FLOOR, FROZEN_COPIES * tensor_bytes(model))


class Freezer:
    """A model's frozen graphs, within its budget; by the caller's bucket key."""

    def __init__(self, model: nn.Module, devices: Sequence[str], whole: bool, store: GraphStore) -> None:
        self.model, self.store = model, store
        self.weights = tensor_bytes(model)
        self.left = freeze_budget(model, devices, whole)  # bytes more frozen copies may take
        self.keys: dict[Any, str] = {}  # bucket → its store key
        self.kernels: dict[Any, list[str]] = {}  # bucket → its attention shapes' kernels
        self.weights_digest: str | None = None  # what the weights are ("" where unreadable)

    def freeze(
        self, what: dict[str, Any], bucket: Any, holding: Callable[[], Callable], example: tuple
    ) -> Callable | None:
        """A frozen graph of `holding()` (a new function holding the model) for `example`, or None
        where the budget is spent or inductor cannot freeze this model (its weights quantized,
        say: then nothing of it freezes from now on, and the caller compiles it unfrozen)."""
        if self.left < self.weights or self.weights == 0:
            return None
        # its weights are its own: one model's frozen graph is never another's (experts) in memory;
        # on disk it is kept by what the weights are (`packages.fingerprint`)
        stored = self.store.key({**what, "frozen": next(self.model.parameters()).data_ptr()})

        def trace() -> tuple[Callable, list[str]]:
            fn = holding()
            kernels = choose_kernels(fn, example)  # each attention shape's, measured here
            return own_code(routed(fn, kernels), f"frozen_{stored}"), list(kernels.values())

        try:
            graph, kernels = self.store.frozen(stored, trace, example, self.model, self._kept(what))
        except Exception as err:
            log.warning("cannot freeze %s (%s): compiling it unfrozen", type(self.model).__name__, err)
            self.store.release(stored)
            self.left = 0
            return None
        self.keys[bucket] = stored
        self.left -= self.weights
        self.store.stats.frozen += 1
        self.kernels[bucket] = kernels
        self.store.stats.attention.update(kernels)
        return graph

    def _kept(self, what: dict[str, Any]) -> str | None:
        """The key this model's graph for `what` is kept on disk by, or None where none is kept."""
        if not self.store.keeps_frozen:
            return None
        if self.weights_digest is None:
            self.weights_digest = packages.fingerprint(self.model) or ""  # hashed once, at the first freeze
        return self.store.key({**what, "weights": self.weights_digest}) if self.weights_digest else None

    def drop(self, bucket: Any) -> None:
        """Forget `bucket`'s frozen graph, if it has one: its copy of the weights is freed."""
        if (stored := self.keys.pop(bucket, None)) is not None:
            self.store.release(stored)
            self.left += self.weights
            self.store.stats.frozen -= 1
            self.store.stats.attention.subtract(self.kernels.pop(bucket))
