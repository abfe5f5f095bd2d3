"""Quantized weights: which layers a mode converts, what they hold afterwards, and whether a
device runs the mode at all.

Only `nn.Linear` weights are converted (torchao's `quantize_` and diffusers' quantizers do the
same): a DiT keeps nearly all its weights there, a UNet under a third (the rest are
convolutions, which stay in the model's dtype). A `Quantization` also names layers kept in full
precision, from the model's root (`proj_out` keeps FLUX.1's output head, not the single blocks'
`proj_out`; diffusers' `modules_to_not_convert` matches anywhere in a name, so give it a list
whose names are unique, such as the UNets'). torchao and bitsandbytes are imported only when a
mode is applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn


class QuantMode(StrEnum):
    OFF = "off"
    INT8 = "int8"  # int8 weights, dequantized in each matmul (torchao Int8WeightOnlyConfig)
    INT8_DYNAMIC = "int8-dynamic"  # int8 weights and per-token int8 activations (int8 matmuls)
    FLOAT8 = "float8"  # float8 weights and activations, per row: GPUs with float8 tensor cores
    NF4 = "nf4"  # bitsandbytes' 4-bit NormalFloat, blockwise absmax: CUDA only


# Bytes one weight of a (out, in) Linear takes, and each output row (scales, zero points):
# torchao's int8 keeps a float32 scale and an int8 zero point a row (measured, in any weight
# dtype), its float8 a float32 scale a row; nf4 half a byte a weight and a float32 absmax a block
# of 64.
WEIGHT_BYTES = {
    QuantMode.INT8: 1.0,
    QuantMode.INT8_DYNAMIC: 1.0,
    QuantMode.FLOAT8: 1.0,
    QuantMode.NF4: 0.5 + 4 / 64,
}
FLOAT8_SCALE_FLOOR = 1e-12  # the smallest absolute maximum a float8 activation row is scaled from
ROW_BYTES = {QuantMode.INT8: 5, QuantMode.INT8_DYNAMIC: 5, QuantMode.FLOAT8: 4, QuantMode.NF4: 0}


@dataclass(frozen=True)
class Quantization:
    """A mode and the layers it leaves alone (`keep`: module names from the root, and their children)."""

    mode: QuantMode = QuantMode.OFF
    keep: tuple[str, ...] = ()
    when_placed: bool = False  # converted as placed whatever the mode (a tensor rank's cut first)

    def __bool__(self) -> bool:
        return self.mode != QuantMode.OFF

    @property
    def on_device(self) -> bool:
        """Converted once its layers sit on their GPU (torchao's float8 converts only there);
        the other modes convert while loading, on the CPU (nf4 then quantizes as it moves),
        unless `when_placed`."""
        return self.mode == QuantMode.FLOAT8 or self.when_placed

    def converts(self, name: str, module: nn.Module) -> bool:
        kept = any(name == k or name.startswith(f"{k}.") for k in self.keep)
        if not bool(self) or not isinstance(module, nn.Linear) or kept:
            return False
        # torchao's float8 matmul needs both sides a multiple of 16 and leaves other layers as
        # they are: counted as such, so the planner's bytes are what the GPU holds
        return self.mode != QuantMode.FLOAT8 or not any(side % 16 for side in module.weight.shape)

    def targets(
        self, model: nn.Module, prefix: str = "", fp32: Sequence[str] | None = None
    ) -> Iterator[tuple[str, nn.Linear]]:
        """The Linear layers of `model` (named from the root as `prefix` says) this mode converts.
        float8 leaves those under a module the loader keeps in float32 (`_keep_in_fp32_modules`,
        matched by name part as diffusers and transformers do: Wan's time embedder, T5's `wo`;
        `fp32`: the root's, where `model` is a part of it): torchao's float8 refuses float32
        weights (Wan's time embedder is one). The int8 modes take float32 weights."""
        if fp32 is None:
            fp32 = getattr(model, "_keep_in_fp32_modules", None) or ()
        kept = set(fp32) if self.mode == QuantMode.FLOAT8 else set()
        for name, module in model.named_modules(prefix=prefix):
            if self.converts(name, module) and not kept.intersection(name.split(".")):
                yield name, module

    def placing(self, root: nn.Module) -> Callable[[nn.Module, str], int]:
        """Quantize `root`'s parts one at a time, as each reaches its device (ModelShard's
        `placed`): float8 converts only on the GPU, and converted block by block the device never
        holds more than one block in 16 bits, so a plan that fits only in float8 loads."""
        fp32 = tuple(getattr(root, "_keep_in_fp32_modules", None) or ())
        return lambda part, path: self.apply(part, path, fp32)

    def bytes(self, model: nn.Module, dtype: torch.dtype, prefix: str = "") -> int:
        """Bytes `model` holds once cast to `dtype` and quantized: counted from shapes (a model on
        the meta device is enough), as the planner needs them before anything loads."""

        def cast(t: torch.Tensor) -> int:
            return t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())

        total = sum(map(cast, (*model.parameters(), *model.buffers())))
        for _, linear in self.targets(model, prefix):
            out_features, in_features = linear.weight.shape
            total -= linear.weight.numel() * dtype.itemsize
            total += round(out_features * in_features * WEIGHT_BYTES[self.mode])
            total += out_features * ROW_BYTES[self.mode]
        return total

    def apply(self, model: nn.Module, prefix: str = "", fp32: Sequence[str] | None = None) -> int:
        """Quantize `model`'s target layers in place (`model`: the part of a root at `prefix`,
        `fp32` the root's float32 modules); the count converted."""
        names = {name.removeprefix(prefix).lstrip(".") for name, _ in self.targets(model, prefix, fp32)}
        if not names:
            return 0
        if self.mode == QuantMode.NF4:
            _to_nf4(model, names)
        else:
            from torchao.quantization import quantize_

            quantize_(model, torchao_config(self.mode), filter_fn=lambda _m, fqn: fqn in names)
        return len(names)


def torchao_config(mode: QuantMode) -> Any:
    """torchao's config object for `mode` (diffusers' `TorchAoConfig` takes the same objects)."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    configs = {
        QuantMode.INT8: Int8WeightOnlyConfig,
        QuantMode.INT8_DYNAMIC: Int8DynamicActivationInt8WeightConfig,
        # a floor under each row's scale: an all-zero row (Wan's padded text context) otherwise
        # gets scale 0 and quantizes to NaN (0/0): a whole video of NaN
        QuantMode.FLOAT8: lambda: Float8DynamicActivationFloat8WeightConfig(
            granularity=PerRow(), activation_value_lb=FLOAT8_SCALE_FLOOR
        ),
    }
    return configs[mode]()


def _to_nf4(model: nn.Module, names: set[str]) -> None:
    """Swap each named Linear for bitsandbytes' Linear4bit holding the same weights: they are
    quantized when the shard moves the layer to its CUDA device (bitsandbytes quantizes there)."""
    import bitsandbytes as bnb  # an extra: diffshard[nf4]

    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = parent.get_submodule(child)
        dtype = linear.weight.dtype
        swapped = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=dtype,
            quant_type="nf4",
            device="meta",
        )
        swapped.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
        if linear.bias is not None:
            swapped.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, child, swapped)


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` really holds: a quantized tensor (a torchao or GGUF subclass) reports its
    logical shape and dtype, so its parts are counted instead."""
    data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
    if type(data) is not torch.Tensor and hasattr(data, "__tensor_flatten__"):
        names, _ = data.__tensor_flatten__()
        return sum(stored_bytes(getattr(data, name)) for name in names)
    return data.numel() * data.element_size()


def refusal(mode: QuantMode, device: str) -> str | None:
    """Why `device` cannot run `mode` (one line naming the device and what it runs), or None."""
    if mode in (QuantMode.OFF, QuantMode.INT8, QuantMode.INT8_DYNAMIC):
        return None
    kind = torch.device(device)
    runs = "off, int8, int8-dynamic"
    if kind.type != "cuda":
        return f"{mode} needs a CUDA GPU; {device} runs {runs}"
    if not torch.cuda.is_available() or (kind.index is not None and kind.index >= torch.cuda.device_count()):
        return f"{mode} needs a CUDA GPU; {device} is not one this host has"
    if mode == QuantMode.FLOAT8 and torch.cuda.get_device_capability(kind) < (8, 9):
        name = torch.cuda.get_device_name(kind)
        return (
            f"float8 needs float8 tensor cores (compute capability 8.9+: L4, L40S, H100); "
            f"{device} ({name}) runs {runs}, nf4"
        )
    if mode == QuantMode.NF4:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return "nf4 needs bitsandbytes: pip install 'diffshard[nf4]'"
    return None


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model` computes in: its floating weights' (a GGUF file's blocks are uint8), but
    for those diffusers keeps in float32 (`_keep_in_fp32_modules`: Wan's `scale_shift_table`
    comes first), as diffusers' own `ModelMixin.dtype` reads it."""
    kept = getattr(model, "_keep_in_fp32_modules", None) or ()
    floating = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point()]
    return next((d for n, d in floating if not any(m in n for m in kept)), floating[0][1])


def layer_features(layer: nn.Linear | nn.Conv2d) -> tuple[int, int]:
    """What a layer maps from and to (an adapter on it must match). A Linear says it: a quantized
    one's weight may be packed (GGUF's and nf4's: uint8 blocks, not [out, in])."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    return layer.weight.shape[1], layer.weight.shape[0]


def layer_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a layer computes in (an adapter's delta is added in it): its weight's, or a
    packed quantized weight's compute dtype (GGUFLinear's and Linear4bit's `compute_dtype`)."""
    dtype = layer.weight.dtype
    if dtype.is_floating_point:
        return dtype
    return getattr(layer, "compute_dtype", None) or torch.float32
