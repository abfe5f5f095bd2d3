"""Device profiles: what well-known GPUs do per second, from their vendors' datasheets.

`plan` may name GPUs this host lacks (a plan for two H100s, read on a laptop). Their blocks
cannot be timed or calibrated, so the cost model (`costs.py`) predicts them from a profile: the
published dense peaks and memory bandwidth, scaled by the fractions below. A host's own devices
are always calibrated instead: a timing beats a datasheet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.errors import ConfigError

# Published figures are peaks no real model reaches. These fractions are estimates (typical of
# eager PyTorch on large diffusion blocks, not measured here): cuBLAS reaches about 60-70% of
# the dense tensor peak on large GEMMs, cuDNN convolutions and fused attention less, and
# streaming kernels about 80% of the memory bandwidth.
MATMUL_SHARE = 0.65
CONV_SHARE = 0.5
ATTENTION_SHARE = 0.4
BANDWIDTH_SHARE = 0.8
LINK_SHARE = 0.8  # of a GPU-to-GPU link's published rate, as copies reach it (an estimate)
# Seconds per op beyond its arithmetic: a kernel launch and eager PyTorch's dispatch, ~5 µs on
# a current host CPU (an estimate; it overlaps large kernels, so counting it in full errs slow).
OP_OVERHEAD_S = 5e-6


@dataclass(frozen=True)
class GpuProfile:
    name: str  # the setting's value
    title: str  # the product, as its datasheet names it
    memory_gib: float
    bandwidth_gb_s: float  # memory bandwidth, GB/s
    fp32_tflops: float  # FP32 without tensor cores (PyTorch's default for float32 matmuls)
    half_tflops: float  # dense FP16 tensor-core peak (FP32 accumulate), without sparsity
    bf16: bool  # bfloat16 on tensor cores (Ampere and later); else it runs at the FP32 rate
    link_gb_s: float = 32.0  # to a peer GPU, one direction: NVLink, else PCIe (GB/s)

    def tflops(self, dtype: torch.dtype) -> float:
        """The dense peak a dtype runs at on this GPU."""
        if dtype == torch.float16 or (dtype == torch.bfloat16 and self.bf16):
            return self.half_tflops
        return self.fp32_tflops

    @property
    def auto_dtype(self) -> torch.dtype:
        """What `--dtype auto` picks on this GPU, as on a real one (`devices.auto_dtype`)."""
        return torch.bfloat16 if self.bf16 else torch.float16

    def describe(self, dtype: torch.dtype) -> str:
        """The figures a prediction rests on, said in the plan's output."""
        kind = str(dtype).removeprefix("torch.")
        return (
            f"{self.title}'s published peaks: {self.tflops(dtype):g} TFLOP/s dense {kind} "
            f"and {self.bandwidth_gb_s / 1000:g} TB/s"
        )


# Vendor datasheets (dense figures: the datasheets' tensor-core numbers "with sparsity" halved):
# NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe), H200 datasheet, A100 datasheet (SXM4
# 40 GB and 80 GB), L40S datasheet, L4 datasheet, A10 datasheet, T4 datasheet, V100 datasheet
# (SXM2), and the Ada Lovelace architecture whitepaper's GeForce RTX 4090 table (FP16 tensor
# with FP32 accumulate, as PyTorch runs it). Links, one direction: NVLink 4 (H100/H200 SXM) 900
# GB/s both ways, NVLink 3 (A100) 600, NVLink 2 (V100) 300; the others PCIe: Gen5 x16 64 GB/s,
# Gen4 x16 32, Gen3 x16 16 (the RTX 4090 has no peer-to-peer: its copies go through the host).
PROFILES = {
    p.name: p
    for p in (
        GpuProfile("h100", "NVIDIA H100 SXM", 80, 3350, 67, 989.4, True, 450),
        GpuProfile("h100-pcie", "NVIDIA H100 PCIe", 80, 2000, 51, 756.5, True, 64),
        GpuProfile("h200", "NVIDIA H200 SXM", 141, 4800, 67, 989.4, True, 450),
        GpuProfile("a100", "NVIDIA A100 SXM 80GB", 80, 2039, 19.5, 312, True, 300),
        GpuProfile("a100-40gb", "NVIDIA A100 SXM 40GB", 40, 1555, 19.5, 312, True, 300),
        GpuProfile("l40s", "NVIDIA L40S", 48, 864, 91.6, 362.05, True, 32),
        GpuProfile("l4", "NVIDIA L4", 24, 300, 30.3, 121, True, 32),
        GpuProfile("a10", "NVIDIA A10", 24, 600, 31.2, 125, True, 32),
        GpuProfile("rtx4090", "NVIDIA GeForce RTX 4090", 24, 1008, 82.6, 165.2, True, 32),
        GpuProfile("v100", "NVIDIA V100 SXM2 32GB", 32, 900, 15.7, 125, False, 150),
        GpuProfile("t4", "NVIDIA T4", 16, 320, 8.1, 65, False, 16),
    )
}
# A GPU named for a plan, with no profile chosen, is taken for the usual datacenter GPU.
DEFAULT_PROFILE = "h100"


def gpu_profile(name: str | None) -> GpuProfile:
    """The profile called `name` (any case), or the default's for None."""
    key = (name or DEFAULT_PROFILE).strip().lower()
    if key not in PROFILES:
        raise ConfigError(f"unknown device profile {name!r}: choose one of {', '.join(PROFILES)}")
    return PROFILES[key]
