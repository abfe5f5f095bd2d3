"""PyTorch's SDPA backend for the denoiser's CUDA attention, chosen by measurement at startup.

On a GPU the backends differ a lot per shape, and which one wins depends on the GPU, the shapes
and the PyTorch build (docs/serving.md has figures, with their host): so no default is baked in.
`measure` times a device's most frequent attention shapes under each backend that runs them
(alternating rounds, medians, weighted by the calls a step makes), `choose` keeps PyTorch's own
choice unless another is `MARGIN` faster, and `put_first` moves the chosen backend to the head of
PyTorch's process-wide priority order. Every backend stays enabled: a call the chosen one cannot
run (a mask, a head size) falls to the next in that order and never fails.

CPU calls are untouched: CPU dispatch keeps its own order (flash, then math) whatever the
priority says, and frozen CPU graphs choose their kernels per shape (`cpu_attention.py`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from server.engine.hardware.devices import wait_for_queued
from server.engine.runtime.cpu_attention import Shape
from server.errors import ConfigError

log = logging.getLogger("diffshard")


class AttentionSetting(enum.StrEnum):
    AUTO = "auto"  # measured at startup on the CUDA devices; nothing on CPUs
    DEFAULT = "default"  # PyTorch's own order
    CUDNN = "cudnn"
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


DEFAULT = "default"  # PyTorch's choice, unforced: measured beside the forced backends
BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
NAMES = {int(backend): name for name, backend in BACKENDS.items()}
# math materializes every score (Wan's 32760 tokens: tens of GB): timed only when asked for by name
MEASURED = (DEFAULT, "cudnn", "flash", "efficient")
MARGIN = 0.03  # another backend must beat PyTorch's choice by this much: noise keeps the default
TOP_SHAPES = 3  # a step's most frequent shapes; the rest are few calls
ROUNDS = 5  # paired rounds at most ...
BUDGET_S = 0.3  # ... and after the first, none begun past this, per device


@dataclass(frozen=True)
class Measured:
    """One device's figures: per backend, the milliseconds a step's timed attention calls take
    (each shape's median × its calls), or None where the backend cannot run every shape."""

    device: str
    ms: dict[str, float | None]
    shapes: tuple[tuple[Shape, int], ...]  # each timed shape, and its calls a step
    rounds: int

    def view(self) -> dict[str, Any]:
        return {
            "ms": {name: None if ms is None else round(ms, 3) for name, ms in self.ms.items()},
            "shapes": [
                {
                    "query": list(s.query),
                    "key": list(s.key),
                    "dtype": str(s.dtype).removeprefix("torch."),
                    "calls": n,
                }
                for s, n in self.shapes
            ],
            "rounds": self.rounds,
        }


@dataclass(frozen=True)
class AttentionChoice:
    """What the denoiser's CUDA attention runs by: `backend` first in PyTorch's order, or
    "default"; the figures it was chosen from; and whether CPU devices serve too (unchanged)."""

    setting: str
    backend: str
    measured: tuple[Measured, ...] = ()
    cpu: bool = False

    def view(self) -> dict[str, Any]:
        """What /v1/stats shows."""
        out: dict[str, Any] = {}
        if self.measured or not self.cpu:
            out |= {"setting": str(self.setting), "backend": self.backend, "order": priority_names()}
            out["devices"] = {m.device: m.view() for m in self.measured}
        if self.cpu:
            out["cpu"] = "as compiled graphs choose"
        return out

    def line(self) -> str:
        """The startup log's line."""
        if not self.measured and self.cpu:
            return f"attention (--attention {self.setting}): CPU devices only, as compiled graphs choose"
        figures = "; ".join(f"{m.device}: {_figures(m)}" for m in self.measured)
        said = f" (ms of a step's attention: {figures})" if figures else ""
        return f"attention (--attention {self.setting}): {self.backend} first on CUDA devices{said}"


def _figures(measured: Measured) -> str:
    return ", ".join(
        f"{name} {'cannot run' if ms is None else f'{ms:.2f}'}" for name, ms in measured.ms.items()
    )


def measure(
    device: str,
    calls: Mapping[Shape, int],
    names: Sequence[str] = MEASURED,
    budget_s: float = BUDGET_S,
) -> Measured:
    """Each of `names` timed on `device` over the `TOP_SHAPES` most frequent of `calls` (shape →
    calls a step), run here and now: whatever runs on this device counts, whatever raises is
    recorded as unable (None). Rounds alternate the backends' order, so drift hits all alike."""
    # 1. The shapes, on the device (random numbers: a kernel's speed does not depend on them)
    top = Counter(calls).most_common(TOP_SHAPES)
    tensors = [tuple(torch.randn(s, dtype=shape.dtype, device=device) for s in shape[:3]) for shape, _ in top]
    # 2. Which backends run every shape (each call also warms its kernel)
    live = [name for name in names if all(_runs(name, qkv) for qkv in tensors)]
    # 3. Paired rounds: every live backend once per shape a round, its place rotated
    times: dict[str, list[list[float]]] = {name: [[] for _ in top] for name in live}
    started, rounds = time.perf_counter(), 0
    while live and rounds < ROUNDS and (rounds == 0 or time.perf_counter() - started < budget_s):
        for name in live[rounds % len(live) :] + live[: rounds % len(live)]:
            for i, qkv in enumerate(tensors):
                times[name][i].append(_seconds(name, qkv, device))
        rounds += 1
    ms = {
        name: sum(count * statistics.median(times[name][i]) for i, (_, count) in enumerate(top)) * 1e3
        if name in live
        else None
        for name in names
    }
    return Measured(device, ms, tuple(top), rounds)


def choose(
    setting: AttentionSetting | str,
    calls: Mapping[str, Mapping[Shape, int]],
    *,
    cpu: bool = False,
    budget_s: float = BUDGET_S,
) -> AttentionChoice:
    """The backend for `setting`, given each CUDA device's attention calls (device → shape →
    calls a step). auto: the lowest total over the devices of those every device runs, if
    `MARGIN` under PyTorch's own; a backend named: probed on each device, refused (ConfigError,
    naming those that ran) where it cannot run the shapes; default: nothing measured."""
    setting = AttentionSetting(setting)
    if setting == AttentionSetting.DEFAULT or (setting == AttentionSetting.AUTO and not calls):
        return AttentionChoice(setting, DEFAULT, cpu=cpu)
    if setting != AttentionSetting.AUTO and not calls:
        raise ConfigError(
            f"--attention {setting} orders PyTorch's CUDA attention backends, and the denoiser runs "
            f"on no CUDA device: use --attention auto or default (DIFFSHARD_ATTENTION)"
        )
    names = MEASURED if setting == AttentionSetting.AUTO else (DEFAULT, str(setting))
    measured = tuple(measure(device, shapes, names, budget_s) for device, shapes in calls.items())
    if setting != AttentionSetting.AUTO:
        for m in measured:
            if m.ms[setting] is None:
                raise _refused(setting, m, calls[m.device])
        return AttentionChoice(setting, str(setting), measured, cpu)
    return AttentionChoice(setting, fastest(measured), measured, cpu)


def fastest(measured: Sequence[Measured]) -> str:
    """The backend of the lowest total over `measured`'s devices, of those every device runs, if
    `MARGIN` under PyTorch's own choice; else "default" (also where that one could not run)."""
    totals = {
        name: sum(m.ms[name] or 0.0 for m in measured)
        for name in MEASURED
        if measured and all(m.ms.get(name) is not None for m in measured)
    }
    if DEFAULT not in totals:  # PyTorch's own choice failed (out of memory?): nothing to compare
        return DEFAULT
    best = min(totals, key=lambda name: totals[name])
    return best if totals[best] < (1 - MARGIN) * totals[DEFAULT] else DEFAULT


def _refused(setting: str, measured: Measured, calls: Mapping[Shape, int]) -> ConfigError:
    """Why `setting` cannot serve on `measured.device`, and the backends that do run there (one round
    of each, timed for nothing but the message)."""
    ran = [name for name, ms in measure(measured.device, calls, MEASURED, 0.0).ms.items() if ms is not None]
    shapes = ", ".join(f"{list(s.query)} over {s.key[2]} keys" for s, _ in measured.shapes)
    return ConfigError(
        f"--attention {setting}: PyTorch cannot run it on {measured.device} for the denoiser's attention "
        f"({shapes}): pick {', '.join(['auto', *ran])} (DIFFSHARD_ATTENTION)"
    )


def put_first(backend: str) -> tuple[int, ...]:
    """`backend` (a BACKENDS name) first in PyTorch's SDPA priority order, process-wide, the others
    after it in their order; "default" changes nothing. Says the order before, for `restore`."""
    before = tuple(torch._C._get_sdp_priority_order())
    if backend != DEFAULT:
        first = int(BACKENDS[backend])
        torch._C._set_sdp_priority_order([first, *(b for b in before if b != first)])
    return before


def restore(order: Sequence[int]) -> None:
    torch._C._set_sdp_priority_order(list(order))


def priority_names() -> list[str]:
    """PyTorch's SDPA priority order now, by our names."""
    return [NAMES[b] for b in torch._C._get_sdp_priority_order() if b in NAMES]


@contextlib.contextmanager
def _forced(name: str) -> Iterator[None]:
    """SDPA by `name` alone (process-wide flags: startup only, before anything else runs)."""
    if name == DEFAULT:
        yield
        return
    with warnings.catch_warnings():  # "... kernel not used because": the refusal is the answer
        warnings.simplefilter("ignore", UserWarning)
        with sdpa_kernel(BACKENDS[name]):
            yield


def _runs(name: str, qkv: tuple[torch.Tensor, ...]) -> bool:
    try:
        with _forced(name), torch.inference_mode():
            F.scaled_dot_product_attention(*qkv)
    except RuntimeError as err:  # "No available kernel", or out of memory at this shape
        log.debug("attention by %s cannot run %s: %s", name, list(qkv[0].shape), err)
        return False
    return True


def _seconds(name: str, qkv: tuple[torch.Tensor, ...], device: str) -> float:
    with _forced(name), torch.inference_mode():
        wait_for_queued([device])
        started = time.perf_counter()
        F.scaled_dot_product_attention(*qkv)
        wait_for_queued([device])
        return time.perf_counter() - started
