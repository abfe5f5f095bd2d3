"""What to serve and where: the model folder, the devices and how the denoiser is split over
them, the weights' dtype and quantization, the adapters and ControlNets beside it, the memory
and threads it runs with. What planning and loading read.

`dtype` is kept as named: what `auto` serves on a CPU is measured, so startup decides it
(`server.startup.decide_dtype`), never the validation."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from server.demo import MODEL_DIR
from server.engine import Costs, Parallel, Strategy
from server.engine.hardware.gpus import DEFAULT_PROFILE, PROFILES
from server.errors import ConfigError
from server.pipeline.conditioning.controlnets import controlnet_folder
from server.pipeline.families import pipeline_classes
from server.pipeline.loading.folder import gguf_tensor_bytes, read_family
from server.pipeline.loading.quantized_parts import QuantizeSetting, check_parts
from server.pipeline.loading.vae_tiling import VaeTiling
from server.settings.values import (
    Budgets,
    Concern,
    ControlNetFolders,
    Devices,
    Folder,
    GpuName,
    Loras,
    PoolBudgets,
    QuantizeValue,
    ServedStrategy,
    VaeTilingValue,
    with_folder,
)

BUILT_IN_NAME = "diffshard-shapes"


class ModelSettings(Concern):
    title = "what to serve, and where: model, devices, placement, dtype, quantization, memory"

    # The model, and the devices it is split over. `model` first: the validators below read it.
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
    max_memory: Budgets = Field(
        None,
        description="per-device budgets, e.g. cuda:0=20GiB,cuda:1=20GiB (default on GPUs: free less 10%)",
    )

    # The weights.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights' dtype; auto: bfloat16 on GPUs that have it, float16 on older GPUs; with a "
        "CPU stage, bfloat16 where the CPU runs it natively and the model's heaviest ops time faster in it "
        "at startup (cached; /v1/stats says why), else float32",
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

    # Adapters and ControlNets served beside it.
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

    # Validators that read files (the folder's family, a GGUF header), never measure.
    @field_validator("model")
    @classmethod
    def _model_folder(cls, folder: Path) -> Path:
        read_family(folder)  # a ModelFolderError (a ValueError) says what is wrong with it
        return folder

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
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return BUILT_IN_NAME if self.model.resolve() == MODEL_DIR.resolve() else self.model.resolve().name
