"""Every setting of the service, in one place: flags of `python -m server serve`, or environment
variables `DIFFSHARD_<NAME>` (flags win). Validated once, at startup, with messages that say
what to fix."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.demo import MODEL_DIR
from server.engine.devices import parse_memory_map, resolve_devices
from server.engine.plan import STRATEGIES
from server.pipeline.loader import check_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUILT_IN_NAME = "diffshard-shapes"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DIFFSHARD_", frozen=True, protected_namespaces=())

    # Where to listen.
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(8000, ge=1, le=65535, description="HTTP API port")
    metrics_port: int = Field(8001, ge=0, le=65535, description="Prometheus /metrics port (0: off)")

    # What to serve, and where.
    model: Path = Field(MODEL_DIR, description="a diffusers Stable Diffusion folder")
    model_name: str | None = Field(None, description="the id /v1/models shows (default: the folder's name)")
    devices: str = Field("auto", description="auto | cpu | cuda:0,cuda:1 ... (UNet stages, in order)")
    strategy: str = Field("memory", description="how to split the UNet: even, memory or cost")
    max_memory: str | None = Field(None, description="per-device budgets, e.g. cuda:0=20GiB,cuda:1=20GiB")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights' dtype; auto: bfloat16 on CUDA, float32 on CPU"
    )
    api_key_file: Path | None = Field(None, description="bearer keys, one a line; unset: no auth")

    # Limits on one request.
    max_n: int = Field(10, ge=1, le=100, description="images per request")
    max_steps: int = Field(100, ge=1, le=1000, description="num_inference_steps")
    max_pixels: int = Field(1024 * 1024, ge=64, description="width x height of one image")
    max_prompt_chars: int = Field(2000, ge=1, description="characters of prompt or negative_prompt")
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="bytes of a request body")

    # The engine loop: batching, overload, deadlines, drain.
    max_batch: int = Field(16, ge=1, le=1024, description="UNet rows per batched step (2 per guided image)")
    max_queue: int = Field(64, ge=1, description="requests waiting for a place; beyond it: 503")
    request_timeout_s: float = Field(300, gt=0, description="a request's deadline from arrival; past it: 504")
    drain_timeout_s: float = Field(30, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    inject_faults: bool = Field(False, description="tests only: [[fail]] or [[oom]] in a prompt fails a step")

    @field_validator("model")
    @classmethod
    def _model_folder(cls, folder: Path) -> Path:
        check_folder(folder)  # a ModelFolderError (a ValueError) says what is wrong with it
        return folder

    @field_validator("devices")
    @classmethod
    def _devices(cls, devices: str) -> str:
        resolve_devices(devices)
        return devices

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, strategy: str) -> str:
        if strategy not in STRATEGIES or strategy == "explicit":
            raise ValueError(f"must be one of {', '.join(s for s in STRATEGIES if s != 'explicit')}")
        return strategy

    @field_validator("max_memory")
    @classmethod
    def _max_memory(cls, max_memory: str | None) -> str | None:
        parse_memory_map(max_memory)
        return max_memory

    @field_validator("api_key_file")
    @classmethod
    def _key_file(cls, path: Path | None) -> Path | None:
        if path is not None and not read_api_keys(path):
            raise ValueError(f"{path} holds no keys: write one key a line")
        return path

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return DTYPES[self.dtype]

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return BUILT_IN_NAME if self.model.resolve() == MODEL_DIR.resolve() else self.model.resolve().name


def read_api_keys(path: Path) -> frozenset[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from err
    return frozenset(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
