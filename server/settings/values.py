"""The typed values of the settings: each parses what a flag or variable says, and a
ValueError's message says what to write (pydantic names the setting). And `Concern`, the base of
each concern's model (server.py, model.py, limits.py, jobs.py, compile.py)."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, ClassVar, Self

import torch
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict
from pydantic_settings import NoDecode

from server.engine import Strategy
from server.engine.hardware.devices import parse_memory_map, parse_size, resolve_devices
from server.engine.hardware.gpus import gpu_profile
from server.engine.runtime.pool import ANY_DEVICE
from server.errors import ConfigError
from server.pipeline.conditioning.controlnets import controlnet_folder
from server.pipeline.loading.quantized_parts import QuantizeSetting, parse_quantize
from server.pipeline.loading.vae_tiling import VaeTiling, parse_vae_tiling
from server.requests.step_cache import StepCache, parse_step_cache
from server.serving.videostore import parse_job_store


class Concern(BaseModel):
    """The fields of one concern, with their validators; `Settings` is every concern at once.
    `of(settings)` is a concern's slice: what a layer is handed, holding nothing else."""

    # validate_default: a default such as devices="auto" is parsed as a given value is;
    # protected_namespaces: `model` and `model_name` are settings, not pydantic's
    model_config = ConfigDict(frozen=True, validate_default=True, protected_namespaces=())
    title: ClassVar[str]  # the heading of its flags in `serve --help`

    @classmethod
    def of(cls, settings: Concern) -> Self:
        """This concern's fields of `settings` (validated already: not again), and which of
        them were set rather than defaulted (`--max-batch` given or not changes a plan)."""
        names = cls.model_fields.keys()
        values = {name: getattr(settings, name) for name in names}
        return cls.model_construct(_fields_set=settings.model_fields_set & names, **values)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Devices = Annotated[tuple[str, ...], NoDecode, BeforeValidator(lambda v: tuple(resolve_devices(v)))]
Budgets = Annotated[dict[str, int], NoDecode, BeforeValidator(lambda v: parse_memory_map(v))]
GpuName = Annotated[str, BeforeValidator(lambda v: gpu_profile(v).name)]
JobStoreURL = Annotated[str, BeforeValidator(parse_job_store)]


def _pool_budgets(value: object) -> dict[str, int]:
    if isinstance(value, str | int) and "=" not in str(value):
        return {ANY_DEVICE: parse_size(value)}
    return parse_memory_map(value)


PoolBudgets = Annotated[dict[str, int], NoDecode, BeforeValidator(_pool_budgets)]
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _named(value: object, check: Callable[[Path], Path], what: str) -> dict[str, Path]:
    """NAME=PATH entries (repeated flags, or one comma-separated variable) → {name: checked path}."""
    entries = (
        value if isinstance(value, list | tuple) else [e for e in str(value or "").split(",") if e.strip()]
    )
    out: dict[str, Path] = {}
    for entry in entries:
        name, _, path = str(entry).partition("=")
        name = name.strip()
        if not ADAPTER_NAME.fullmatch(name) or not path:
            raise ValueError(f"write NAME=PATH (a name of letters, digits, _ . -), got {entry!r}")
        if name in out:
            raise ValueError(f"two {what} are named {name!r}")
        out[name] = check(Path(path.strip()))
    return out


def _adapter_file(path: Path) -> Path:
    if path.suffix != ".safetensors" or not path.is_file():
        raise ValueError(f"{path} is not a .safetensors file (adapters load from safetensors only)")
    return path


def _folder(path: Path) -> Path:
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder")
    return path


Folder = Annotated[Path, AfterValidator(_folder)]


SERVED_STRATEGIES = tuple(s for s in Strategy if s != Strategy.EXPLICIT)  # explicit: `plan --layout`


def _served_strategy(strategy: Strategy) -> Strategy:
    if strategy not in SERVED_STRATEGIES:
        raise ValueError(f"must be one of {', '.join(SERVED_STRATEGIES)}")
    return strategy


ServedStrategy = Annotated[Strategy, AfterValidator(_served_strategy)]


def _key_file(path: Path) -> Path:
    if not read_api_keys(path):
        raise ValueError(f"{path} holds no keys: write one key a line")
    return path


KeyFile = Annotated[Path, AfterValidator(_key_file)]


def with_folder(given: dict[str, Path], found: dict[str, Path], what: str, flags: str) -> dict[str, Path]:
    """NAME=PATH entries, then those a folder holds (a name given twice: ConfigError naming `flags`)."""
    for name in given.keys() & found.keys():
        raise ConfigError(f"two {what} are named {name!r} ({flags})")
    return given | found


Loras = Annotated[dict[str, Path], NoDecode, BeforeValidator(lambda v: _named(v, _adapter_file, "adapters"))]
ControlNetFolders = Annotated[
    dict[str, Path], NoDecode, BeforeValidator(lambda v: _named(v, controlnet_folder, "ControlNets"))
]


def _sizes(value: object) -> tuple[int, ...]:
    items = value if isinstance(value, list | tuple) else str(value or "").split(",")
    sizes = tuple(int(str(item).strip()) for item in items if str(item).strip())
    if any(size < 8 or size % 8 for size in sizes):
        raise ValueError(f"image sides must be multiples of 8, got {list(sizes)}")
    return sizes


CompileSizes = Annotated[tuple[int, ...], NoDecode, BeforeValidator(_sizes)]
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # what a browser on this host sends as Host
HOST_PATTERN = re.compile(r"\*|(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*|\[[0-9a-f:.]+\]")


def _hosts(value: object) -> tuple[str, ...] | None:
    """Host names as Starlette's TrustedHostMiddleware takes them: `*`, `*.example.com` or exact."""
    if value is None:
        return None
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    hosts = tuple(str(item).strip().lower() for item in items if str(item).strip())
    for host in hosts:
        if not HOST_PATTERN.fullmatch(host):
            raise ValueError(f"write *, *.example.com or a host (no scheme, port or path), got {host!r}")
    if not hosts:
        raise ValueError("name at least one host, or * for any")
    return hosts


AllowedHosts = Annotated[tuple[str, ...] | None, NoDecode, BeforeValidator(_hosts)]


QuantizeValue = Annotated[QuantizeSetting, NoDecode, BeforeValidator(parse_quantize)]

# parse_step_cache raises InvalidRequest, a ValueError: pydantic reports it with the setting's name
StepCacheSetting = Annotated[StepCache, NoDecode, BeforeValidator(parse_step_cache)]
VaeTilingValue = Annotated[VaeTiling, BeforeValidator(parse_vae_tiling)]


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def trusted_hosts(allowed: tuple[str, ...] | None, host: str) -> tuple[str, ...]:
    """`allowed`, or by default the loopback names on a loopback address (a web page's DNS
    rebinding cannot reach it) and any host elsewhere (pod IPs, Service names, ingresses)."""
    if allowed is not None:
        return allowed
    if not is_loopback(host):
        return ("*",)
    bound = f"[{host}]" if ":" in host else host.lower()
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, bound)))


def read_api_keys(path: Path) -> frozenset[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from err
    return frozenset(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
