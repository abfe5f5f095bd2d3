"""Device names and byte sizes as users write them: `auto`, `cpu,cpu`, `cuda:0=20GiB`."""

from __future__ import annotations

import contextlib
import logging
import platform
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

from server.engine.hardware.gpus import gpu_profile
from server.errors import DeviceError

log = logging.getLogger("diffshard")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


# Set while only planning (`python -m server plan`): GPUs this host lacks may be named, since a
# plan on the meta device needs none; serving never sets it.
_ABSENT_OK: ContextVar[bool] = ContextVar("plan_absent_devices", default=False)


@contextmanager
def planning_absent_devices() -> Iterator[None]:
    """While planning only: CUDA devices this host lacks are accepted (their budgets must then
    be given; their speed and auto dtype come from a device profile, `gpus.py`), so a plan for
    two GPUs can be read before buying them."""
    token = _ABSENT_OK.set(True)
    try:
        yield
    finally:
        _ABSENT_OK.reset(token)


def absent(device: str) -> bool:
    """A CUDA device named for a plan that this host does not have."""
    dev = torch.device(device)
    return dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count()


def normalize_device(name: str) -> str:
    """`'cuda'` → `'cuda:0'`; raises DeviceError for a device this host does not have."""
    try:
        device = torch.device(name.strip())
    except RuntimeError as err:
        raise DeviceError(f"unknown device {name!r}: use cpu or cuda:N") from err
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        index = device.index or 0
        count = torch.cuda.device_count()
        if index >= count and not _ABSENT_OK.get():
            raise DeviceError(f"unknown device {name!r}: this host has {count} CUDA device(s)")
        return f"cuda:{index}"
    raise DeviceError(f"unsupported device {name!r}: use cpu or cuda:N")


def resolve_devices(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """`auto` = every visible CUDA device, else `cpu`; a list may repeat a device."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    if [n.strip() for n in names] == ["auto"]:
        count = torch.cuda.device_count()
        if not count:
            log.warning("devices=auto found no CUDA device (torch %s): running on the CPU", torch.__version__)
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    if not names or any(not n.strip() for n in names):
        raise DeviceError(f"empty device in {spec!r}")
    return [normalize_device(n) for n in names]


def separate_memories(devices: Sequence[str]) -> bool:
    """Distinct GPUs, each its own memory (the CPU's workers share one): what placing parts apart
    (experts, a text encoder's layers) needs to gain anything."""
    return len(set(devices)) == len(devices) and not any(d.startswith("cpu") for d in devices)


def parse_size(text: str | int) -> int:
    """`'20GiB'` → 21474836480; plain numbers are bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match or match[2].lower() not in _UNITS:
        raise DeviceError(f"bad size {text!r}: write e.g. 512MiB, 20GiB or 2.5GB")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def parse_memory_map(spec: str | dict[str, str | int] | None) -> dict[str, int]:
    """`'cuda:0=20GiB,cpu=64GiB'` (or a dict) → `{'cuda:0': bytes, 'cpu': bytes}`."""
    if not spec:
        return {}
    items = (
        spec.items()
        if isinstance(spec, dict)
        else (part.split("=", 1) if "=" in part else (part, "") for part in spec.split(","))
    )
    budgets: dict[str, int] = {}
    for device, size in items:
        if size == "":
            raise DeviceError(f"bad max-memory entry {device!r}: write DEVICE=SIZE, e.g. cuda:0=20GiB")
        budgets[normalize_device(device)] = parse_size(size)
    return budgets


# Without --max-memory, a CUDA device's budget is its free memory less this share of its total:
# room for the CUDA context, other processes' growth and allocator fragmentation.
CUDA_MARGIN = 0.10


def default_budget(device: str) -> int | None:
    """A CUDA device's free bytes less `CUDA_MARGIN` of its total; None (no bound) for the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if absent(device):
        raise DeviceError(f"{device} is not on this host: give its budget, e.g. --max-memory {device}=24GiB")
    free, total = torch.cuda.mem_get_info(dev)
    return max(0, int(free - CUDA_MARGIN * total))


def auto_dtype(devices: list[str], profile: str | None = None) -> torch.dtype:
    """bfloat16 where every device is a GPU that runs it natively, float16 on older GPUs,
    float32 as soon as one stage runs on the CPU (one dtype for the whole model). A GPU this
    host lacks (named for a plan) is judged by its device profile (`gpus.py`, default h100)."""
    if any(torch.device(d).type != "cuda" for d in devices):
        return torch.float32

    def native_bf16(device: str) -> bool:
        if absent(device):
            return gpu_profile(profile).bf16
        return torch.cuda.get_device_capability(torch.device(device)) >= (8, 0)

    return torch.bfloat16 if all(native_bf16(d) for d in devices) else torch.float16


def cpu_dtype() -> torch.dtype:
    """bfloat16 where this CPU runs it natively (AVX-512 with bf16, AMX), else float32: on an
    AVX2-only CPU bfloat16 matmul is emulated, ~180× slower than float32 (measured)."""
    flags = ""
    with contextlib.suppress(OSError):
        flags = Path("/proc/cpuinfo").read_text()
    native = " avx512_bf16" in flags or " amx_bf16" in flags
    return torch.bfloat16 if native else torch.float32


def format_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def device_kind(device: str) -> str:
    """What a calibration describes: the processor (CPU workers) or the GPU model."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return _cpu_name()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()} ({torch.backends.cpu.get_cpu_capability()})"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} ({torch.backends.cpu.get_cpu_capability()})"


def device_set(device: torch.device | str) -> contextlib.AbstractContextManager[None]:
    """This thread's current CUDA device is `device` while inside (nothing for the CPU): a helper
    thread that runs a rank or a replica on GPU k builds its handles and workspaces there, not on
    GPU 0, and its work goes to GPU k's default stream."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def host_values(values: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(values)` on `device`, copied there without the host waiting: from pinned
    memory, queued on the stream (made on a GPU straight from a list, or copied from pageable
    memory, a tensor first waits for all the work queued there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def wait_for_queued(devices: Iterable[str], fences: Mapping[str, torch.cuda.Event] | None = None) -> None:
    """Wait until the work this thread queued on each CUDA device is done: up to `fences[d]`
    where given (a pipelined lane's call left that stage there, and the next lane's work may
    follow it), else up to an event recorded now. A device-wide `torch.cuda.synchronize` would
    wait for every other thread's work on those GPUs too."""
    fences = fences or {}
    events = []
    for device in sorted({d for d in devices if d.startswith("cuda")}):
        event = fences.get(device)
        if event is None:
            event = torch.cuda.Event()
            with torch.cuda.device(device):
                event.record()
        events.append(event)
    for event in events:
        event.synchronize()


def worker_names(devices: Sequence[str]) -> list[str]:
    """A name per stage or replica: its device, indexed where a device is listed more than once.
    `cpu,cpu`: two CPU workers sharing the host's cores are `cpu:0` and `cpu:1`; `cuda:0,cuda:0`:
    two workers on one GPU are `cuda:0#0` and `cuda:0#1` (`#`, so no name reads as another GPU's
    index). A name labels books and metrics only: never a device to pass to torch."""
    counts = Counter(devices)
    seen: Counter[str] = Counter()
    names = []
    for device in devices:
        if counts[device] == 1:
            names.append(device)
        else:
            names.append(f"{device}{'#' if ':' in device else ':'}{seen[device]}")
        seen[device] += 1
    if len(set(names)) != len(names):
        raise ValueError(f"a device is listed twice under different names: {list(devices)}")
    return names
