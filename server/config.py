"""Every setting of the service, in one place: flags of `python -m server serve` (and, for those
that shape a plan, of `python -m server plan`), or environment variables `DIFFSHARD_<NAME>`
(flags win). Validated once, at startup, into typed values (a device list, byte budgets per
device, a strategy), with messages that say what to fix."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.config_values import (
    AllowedHosts,
    Budgets,
    CompileSizes,
    ControlNetFolders,
    Devices,
    Folder,
    GpuName,
    JobStoreURL,
    KeyFile,
    Loras,
    PoolBudgets,
    QuantizeValue,
    ServedStrategy,
    StepCacheSetting,
    VaeTilingValue,
    trusted_hosts,
    with_folder,
)
from server.demo import MODEL_DIR
from server.engine import Costs, Parallel, Strategy
from server.engine.hardware.devices import auto_dtype
from server.engine.hardware.gpus import DEFAULT_PROFILE, PROFILES
from server.engine.hardware.threads import cpu_quota
from server.engine.planning.cache import default_cache_dir
from server.engine.planning.calibrate import cpu_serves_bf16
from server.engine.runtime.compile import CompileMode
from server.engine.runtime.graphs import CompileRoute
from server.engine.runtime.sdpa_backend import AttentionSetting
from server.errors import ConfigError
from server.pipeline.conditioning.controlnets import controlnet_folder
from server.pipeline.families import pipeline_classes
from server.pipeline.loading.folder import gguf_tensor_bytes, read_family
from server.pipeline.loading.quantized_parts import QuantizeSetting, check_parts
from server.pipeline.loading.vae_tiling import VaeTiling
from server.requests.step_cache import StepCache
from server.serving.videos import RUNNING_VIDEOS
from server.serving.videostore import default_job_store

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUILT_IN_NAME = "diffshard-shapes"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DIFFSHARD_", frozen=True, protected_namespaces=(), validate_default=True
    )

    # Where to listen.
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(8000, ge=1, le=65535, description="HTTP API port")
    metrics_port: int = Field(8001, ge=0, le=65535, description="/metrics and the probes; no auth (0: off)")
    allowed_hosts: AllowedHosts = Field(
        None,
        description="Host headers the API answers, e.g. api.example.com,*.example.com or * (default: "
        "localhost, 127.0.0.1 and [::1] when host is a loopback address, else *)",
    )

    # What to serve, and where.
    model: Path = Field(
        MODEL_DIR, description=f"a diffusers pipeline folder: {', '.join(pipeline_classes())}"
    )
    model_name: str | None = Field(None, description="the id /v1/models shows (default: the folder's name)")
    devices: Devices = Field(
        "auto", description="auto (every GPU, else cpu) | cpu | cuda:0,cuda:1 ... in order"
    )
    strategy: ServedStrategy = Field(
        Strategy.MEMORY, description="how to split the denoiser: even, memory or cost"
    )
    parallel: Parallel = Field(
        Parallel.AUTO,
        description="with several devices: replicas, pipeline (stages busy with micro-batches at once), "
        "sequence (every call's tokens split over the replicas: transformer denoisers), tensor (every "
        "transformer block's heads and MLPs split over every device), experts (a model's "
        "experts each on its own devices: Wan 2.2 A14B), auto (the fastest "
        "predicted; a lone request's rows or tokens split over idle replicas) or off (one split, "
        "one micro-batch: the least memory)",
    )
    layout: str | None = Field(
        None,
        pattern=r"^[1-9][0-9]*x[1-9][0-9]*x[1-9][0-9]*$",
        description="R x S x T: R replicas of S stages, each stage a tensor group of T devices "
        "(1x1x2: one tensor group of two; 2x1x2: two replicas, each a tensor group of two); "
        "the devices, in order, must number R·S·T; unset: --parallel chooses",
    )
    costs: Costs = Field(
        Costs.COUNTED,
        description="what plans are predicted from: counted (FLOPs, bytes and ops on the meta device, "
        "seconds) or measured (every block timed on random weights: minutes on a CPU; cached)",
    )
    device_profile: GpuName = Field(
        DEFAULT_PROFILE,
        description=f"the GPU that CUDA devices this host lacks are predicted as, from its published "
        f"peaks: {', '.join(PROFILES)} (this host's own devices are calibrated)",
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="where calibrations and measured costs are kept ($XDG_CACHE_HOME/diffshard); "
        "unwritable: a warning, and they are timed again",
    )
    job_store: JobStoreURL = Field(
        default_factory=default_job_store,
        description="where video jobs live, surviving restarts: sqlite:///PATH (one server; default: "
        "under $XDG_DATA_HOME/diffshard) or redis://HOST:PORT/DB (replicas share it)",
    )
    video_lease_s: float = Field(
        30, ge=1, le=3600, description="seconds a running video job's lease lasts unrenewed (Redis store)"
    )
    video_fps: int = Field(16, ge=1, le=120, description="frames a second of the videos made (Wan: 16)")
    video_timeout_s: float = Field(
        3600, gt=0, description="a video job's deadline, from when a runner takes it from the store "
        "(waiting in the step loop's line counts, waiting in the store does not); past it: failed",
    )  # fmt: skip
    video_expiry_s: int = Field(86400, ge=60, description="seconds a finished video stays downloadable")
    video_store_bytes: int = Field(
        10 * 1024**3, ge=1, description="the finished videos' content in all; past it the oldest go"
    )
    max_running_videos: int = Field(
        RUNNING_VIDEOS, ge=1, le=64, description="video jobs a replica runs at once, their steps batched "
        "by the step loop (each one claimed is held from the store's other replicas)",
    )  # fmt: skip
    compile: CompileMode = Field(
        CompileMode.AUTO,
        description="off | full (the whole denoiser, one stage) | blocks (each block: composes with "
        "stages) | auto (full or blocks as the plan allows, each bucket kept where its calls measured "
        "faster than eager); compiled per shape bucket in the background, kept in cache_dir for the "
        "next start",
    )
    attention: AttentionSetting = Field(
        AttentionSetting.AUTO, description="PyTorch's attention backend on the denoiser's CUDA devices: "
        "auto (each timed on the served shapes at startup; the fastest first where over 3% faster than "
        "default) | default (PyTorch's order) | cudnn | flash | efficient | math (first; a call it cannot "
        "run falls to the next); CPU devices: unchanged",
    )  # fmt: skip
    compile_sizes: CompileSizes = Field(
        None, description="image sides to compile, e.g. 64,128 (default: the model's default size)"
    )
    compile_budget_s: float = Field(
        1800, gt=0, description="seconds the background compile may take: once a bucket ends past it, "
        "no other is begun and the calls they would hold run eagerly (a lone image's come first)",
    )  # fmt: skip
    compile_route: CompileRoute = Field(
        CompileRoute.AUTO, description="aot (graphs compiled ahead of time, kept whole in cache_dir: "
        "PyTorch 2.13) | jit (traced at every start, inductor's caches and artifacts kept in cache_dir: "
        "any PyTorch) | auto (aot where this PyTorch has it)",
    )  # fmt: skip
    max_memory: Budgets = Field(
        None,
        description="per-device budgets, e.g. cuda:0=20GiB,cuda:1=20GiB (default on GPUs: free less 10%)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights' dtype; auto: bfloat16 on GPUs that have it, float16 on older GPUs; with a "
        "CPU stage, bfloat16 where the CPU runs it natively and measures it faster at startup, else float32",
    )
    quantize: QuantizeValue = Field(
        "off",
        description="quantized weights: off | int8 (weight-only) | int8-dynamic (int8 weights and "
        "activations) | float8 (GPUs with float8 tensor cores) | nf4 (CUDA, bitsandbytes); alone: the "
        "denoiser and every text encoder over 1 GiB; or per part, e.g. "
        "denoiser=int8-dynamic,text_encoder_2=int8",
    )
    denoiser_file: Path | None = Field(
        None,
        description="a GGUF file (Q8_0, Q5_K, Q4_K...) holding the denoiser's weights, in place of the "
        "folder's (its config still comes from the folder)",
    )
    lora: Loras = Field(
        None,
        description="a LoRA adapter NAME=PATH to serve (repeat the flag; in the variable: comma-separated)",
        json_schema_extra={"repeatable": True},
    )
    controlnet: ControlNetFolders = Field(
        None,
        description="a ControlNet NAME=FOLDER to serve (diffusers' format, safetensors; repeat the flag; "
        "in the variable: comma-separated)",
        json_schema_extra={"repeatable": True},
    )
    lora_dir: Folder | None = Field(
        None,
        description="a folder whose every .safetensors file is an adapter, named by its stem; admins "
        "load more from it at runtime (POST /v1/adapters)",
    )
    controlnet_dir: Folder | None = Field(
        None,
        description="a folder whose every subfolder is a ControlNet, named by it; admins load more from "
        "it at runtime (POST /v1/controlnets)",
    )
    api_key_file: KeyFile | None = Field(None, description="bearer keys, one a line; unset: no auth")
    admin_key_file: KeyFile | None = Field(
        None, description="operators' bearer keys, one a line: they also see every key's jobs in /v1/stats"
    )

    # Limits on one request.
    max_n: int = Field(10, ge=1, le=100, description="images per request")
    max_steps: int = Field(100, ge=1, le=1000, description="num_inference_steps")
    max_pixels: int | None = Field(
        None, ge=64, description="width x height of one image (default: 4x the model's native area)"
    )
    max_work: float = Field(
        1000,
        gt=0,
        description="n x steps x pixels (x a video's latent frames) / native pixels of one "
        "request (native-image steps; a video model's default: x its default clip's latent frames)",
    )
    max_prompt_chars: int = Field(2000, ge=1, description="characters of prompt or negative_prompt")
    max_body_bytes: int = Field(
        64 * 1024, ge=1024, description="bytes of a request body (edits: beside their images)"
    )
    max_image_bytes: int = Field(
        4 * 2**20, ge=1024, description="bytes of one image or mask sent to /v1/images/edits"
    )
    max_image_pixels: int | None = Field(
        None, ge=64, description="width x height of one image sent to edit (default: 4x max_pixels)"
    )
    max_edit_images: int = Field(4, ge=1, le=16, description="images one edit request may send")

    # Connections.
    read_timeout_s: float = Field(30, gt=0, description="time a client may take to send headers and body")
    sse_keepalive_s: float = Field(
        15, gt=0, le=300, description="a stream quiet this long sends an SSE comment, so proxies keep it open"
    )
    max_connections: int = Field(512, ge=1, description="concurrent connections; beyond it: 503")

    # The step loop: batching, overload, deadlines, drain.
    max_batch: int = Field(
        16, ge=1, le=1024, description="denoiser rows per batched step (2 per guided image)"
    )
    step_budget: Annotated[float, Field(gt=0)] | Literal["auto", "off"] = Field(
        "auto",
        description="work one batched step may take, in rows of the model's native size (rows x "
        "pixels / native pixels; a larger request runs alone); auto: the knee the planner's costs "
        "predict (where doubling rows adds < 10% rows/s); off: only --max-batch",
    )
    default_steps: int | None = Field(
        None, ge=1, le=1000, description="num_inference_steps of a request naming none (default: the "
        "folder's recommended.json, else its pipeline's: Z-Image-Turbo 8, a Z-Image base folder 50)",
    )  # fmt: skip
    default_guidance: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="guidance_scale of a request naming none (default: "
        "the folder's recommended.json, else its pipeline's: Z-Image-Turbo 0, a Z-Image base folder 5)",
    )  # fmt: skip
    step_cache: StepCacheSetting = Field(
        StepCache(),
        description="a request's step_cache when it sends none: off, deep (UNets), first_block "
        '(MMDiTs), or JSON, e.g. {"policy": "deep", "interval": 3}; off keeps diffusers\' images',
    )
    max_queue: int = Field(64, ge=1, description="requests waiting for a place; beyond it: 503")
    max_queue_per_key: int | None = Field(
        None,
        ge=1,
        description="requests one API key may have waiting; beyond it: 429 (default: half of max_queue)",
    )
    request_timeout_s: float = Field(300, gt=0, description="a request's deadline from arrival; past it: 504")
    drain_timeout_s: float = Field(30, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    step_timeout_s: float = Field(
        120,
        gt=0,
        description="a step of max_batch native-size rows running longer than this (more work: "
        "proportionally longer) fails /readyz until it returns; 4x longer fails /livez",
    )
    failures_unready: int = Field(
        3, ge=1, description="consecutive failed steps (not out-of-memory) that fail /readyz"
    )
    inject_faults: bool = Field(
        False,
        description="tests only: [[fail]], [[oom]], [[hang]], [[slow]], [[decode]] or [[kill]] in a prompt "
        "fails there",
    )

    # Memory and threads.
    pool_budget: PoolBudgets = Field(
        None,
        description="idle bytes the activation pool may keep per device, SIZE or device=SIZE,... "
        "(default: 5% of the host's RAM for cpu, 10% of a GPU's memory)",
    )
    vae_tiling: VaeTilingValue = Field(
        VaeTiling.AUTO,
        description="VAE decoding (and an edit's encoding) in tiles, as diffusers' enable_tiling: on "
        "(images larger than the VAE's tile), off, or auto (on where the VAE's device has a budget and "
        "the largest image decoded whole is predicted over the plan's activation reserve; plan prints both)",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU intra-op threads in all, shared by the CPU workers; a lone CPU worker runs "
        "exactly this many (default: the CPU quota, and a lone worker the count predicted fastest)",
    )
    debug: bool = Field(False, description="print tracebacks of startup failures")

    @field_validator("model")
    @classmethod
    def _model_folder(cls, folder: Path) -> Path:
        read_family(folder)  # a ModelFolderError (a ValueError) says what is wrong with it
        return folder

    @field_validator("step_cache")
    @classmethod
    def _step_cache_fits(cls, policy: StepCache, info) -> StepCache:
        model = info.data.get("model")
        family = read_family(model) if model is not None else None
        if family is not None and policy.policy not in family.step_caches:
            served = ", ".join(family.step_caches)
            raise ValueError(f"{policy.policy!r} does not fit a {family.name} model: use one of {served}")
        return policy

    @field_validator("quantize")
    @classmethod
    def _quantize_parts(cls, setting: QuantizeSetting, info) -> QuantizeSetting:
        if (model := info.data.get("model")) is not None:
            check_parts(setting, read_family(model))
        return setting

    @field_validator("denoiser_file")
    @classmethod
    def _denoiser_file(cls, path: Path | None, info) -> Path | None:
        if path is None:
            return None
        if path.suffix != ".gguf" or not path.is_file():
            raise ValueError(f"{path} is not a .gguf file")
        if "denoiser" in info.data.get("quantize", {}):
            raise ValueError("a GGUF file is quantized already: drop denoiser= from --quantize")
        gguf_tensor_bytes(path)  # an unreadable file fails now, naming it
        return path

    @field_validator("max_memory")
    @classmethod
    def _budgets_name_devices(cls, budgets: dict[str, int], info) -> dict[str, int]:
        devices = info.data.get("devices", ())
        for device in budgets:
            if devices and device not in devices:
                raise ValueError(f"names {device}, which is not among the devices {list(devices)}")
        return budgets

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype`; auto: the GPUs' best (`auto_dtype`), and with a CPU stage bfloat16 only where
        the CPU runs it natively and measures faster (`cpu_serves_bf16`), else float32."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        gpus = [d for d in self.devices if d.startswith("cuda")]
        best = auto_dtype(gpus, self.device_profile) if gpus else torch.bfloat16
        if len(gpus) == len(self.devices):
            return best
        cpu_bf16 = cpu_serves_bf16(self.threads or cpu_quota(), self.cache_dir)
        return torch.bfloat16 if cpu_bf16 and best == torch.bfloat16 else torch.float32

    @property
    def adapters(self) -> dict[str, Path]:
        """Every adapter to serve: `lora` entries, then `lora_dir`'s files (a name given twice: error)."""
        files = sorted(self.lora_dir.glob("*.safetensors")) if self.lora_dir else []
        return with_folder(self.lora, {f.stem: f for f in files}, "adapters", "--lora and --lora-dir")

    @property
    def controlnets(self) -> dict[str, Path]:
        """Every ControlNet to serve: `controlnet` entries, then `controlnet_dir`'s subfolders."""
        found = sorted(p for p in self.controlnet_dir.iterdir() if p.is_dir()) if self.controlnet_dir else []
        try:
            listed = {p.name: controlnet_folder(p) for p in found}
        except ValueError as error:
            raise ConfigError(f"--controlnet-dir: {error}") from None
        return with_folder(self.controlnet, listed, "ControlNets", "--controlnet and --controlnet-dir")

    @property
    def trusted_hosts(self) -> tuple[str, ...]:
        return trusted_hosts(self.allowed_hosts, self.host)

    @property
    def key_queue_limit(self) -> int:
        """Requests one API key may have waiting (`max_queue_per_key`, default half the line)."""
        return self.max_queue_per_key or max(1, self.max_queue // 2)

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return BUILT_IN_NAME if self.model.resolve() == MODEL_DIR.resolve() else self.model.resolve().name

    @property
    def edit_body_bytes(self) -> int:
        """An edit's body: its images and mask at their limit, beside the other fields."""
        return (self.max_edit_images + 1) * self.max_image_bytes + self.max_body_bytes
