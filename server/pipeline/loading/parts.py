"""Where the parts around the denoiser sit: the text encoders, any image encoder and the VAE on
one device (the first stage's, or `encoder_device`), the text encoders' layers of a tensor group
on separate GPUs spread over its ranks.

Spread, because FLUX.2-dev's Mistral 3 is 43.6 GiB in bfloat16: more than a rank can hold beside
its 30.8 GiB share of the transformer and its activations on an 80 GiB GPU, while a share on each
rank fits (`plan` counts it so: `TensorAxis._rank_options`).

Only the largest text encoder is spread (FLUX.1's T5 beside CLIP-L, FLUX.2's Mistral): a small
one spread gains no memory and pays its copies. Its largest run of layers is cut into
consecutive parts of about equal bytes, one per device, the rest of it (embeddings, norms, a
vision tower) left on the first. Each moved layer takes its inputs to its device, runs with that
device as the thread's current one, and gives its hidden states back to the first: families read
a layer's hidden states (FLUX.2 stacks three) and call an encoder's submodules, so every hidden
state they see is on the first device. That is two copies of a [rows, tokens, hidden] state per
moved layer, once per encoding: FLUX.2's 512 tokens × 5120 at 2 rows is 10 MiB a copy. What else
a layer returns (T5's position bias, heads × tokens² a copy) stays where it was made, for the
next layer there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from server.engine.denoisers.blocks import tensor_bytes
from server.pipeline.loading.folder import Components
from server.pipeline.loading.vae_tiling import set_tiling


def place_parts(
    components: Components, device: torch.device, spread: Sequence[str], vae_tiling: bool
) -> tuple[tuple[nn.Module, ...], nn.Module]:
    """The text encoders (on `device`, or spread over `spread`'s devices) and the VAE (on
    `device`, in float32 where it overflows in float16, tiled as asked, channels-last on a CPU);
    an image encoder goes to `device` too."""
    largest = max(components.text_encoders, key=tensor_bytes, default=None)
    encoders = []
    for name, encoder in zip(components.family.text_encoders, components.text_encoders, strict=False):
        quantization = components.on_device.get(name)  # converted piece by piece as placed
        converts = quantization.placing(encoder) if quantization else None
        spreading = bool(spread) and encoder is largest
        if spreading or converts:
            encoders.append(spread_encoder(encoder, spread if spreading else [str(device)], converts))
        else:
            encoders.append(encoder.to(device))
    if components.image_encoder is not None:  # image-to-video's, beside the text encoders
        components.image_encoder.to(device)
    vae = components.vae
    upcast = vae.dtype == torch.float16 and vae.config.get("force_upcast", False)
    if vae.dtype != torch.float32 and (upcast or components.family.vae_float32):
        vae.to(torch.float32)  # such VAEs overflow in float16: diffusers upcasts them too
    vae = set_tiling(vae, vae_tiling).to(device)  # diffusers' tiles (tiling.py)
    if device.type == "cpu":
        channels_last(vae)
    return tuple(encoders), vae


def channels_last(model: nn.Module) -> None:
    """`model`'s 2-D convolutions' weights in channels-last order, so their outputs are too: oneDNN
    runs convolutions channels-last, and a VAE's weights in PyTorch's default order are reordered
    at every call (an SD VAE's decode at 256² took 14–17% less, docs/serving.md). A video VAE's
    3-D convolutions stay as they are."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.to(memory_format=torch.channels_last)


def layer_devices(model: nn.Module, devices: Sequence[str]) -> tuple[str, dict[int, str]]:
    """The path of `model`'s largest `ModuleList` and where each of its layers goes, in consecutive
    runs of about a device's share of the model's bytes, the rest of the model counted on the first."""
    path, layers = max(
        ((name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)),
        key=lambda item: tensor_bytes(item[1]),
    )
    sizes = [tensor_bytes(layer) for layer in layers]
    share = tensor_bytes(model) / len(devices)
    held = tensor_bytes(model) - sum(sizes)  # the rest, on the first device
    placed = {}
    for i, size in enumerate(sizes):  # a layer goes where its middle falls
        placed[i] = devices[min(len(devices) - 1, int((held + size / 2) // share))]
        held += size
    return path, placed


def spread_encoder(
    model: nn.Module, devices: Sequence[str], converts: Callable[[nn.Module, str], object] | None = None
) -> nn.Module:
    """`model` over `devices` by `layer_devices`, every output on the first. Each part goes
    straight to its device: the whole encoder may not fit the first; `converts(part, path)` right
    after (float8: the device holds one layer in 16 bits at most, not the whole encoder)."""
    first = torch.device(devices[0])
    path, placed = layer_devices(model, devices)
    parent, prefix = model, ""
    for step in path.split("."):  # the rest: the modules beside the way down to the layers
        parent._apply(lambda t: t.to(first), recurse=False)  # their own tensors (nn.Module.to's way)
        for name, child in parent.named_children():
            if name != step:
                child.to(first)
                if converts is not None:
                    converts(child, f"{prefix}{name}")
        parent, prefix = parent.get_submodule(step), f"{prefix}{step}."
    for i, device in placed.items():
        layer = parent[i].to(device)
        if converts is not None:
            converts(layer, f"{path}.{i}")
        if device != devices[0]:
            layer.register_forward_pre_hook(partial(_inputs_to, torch.device(device)), with_kwargs=True)
            layer.register_forward_hook(partial(_output_to, first))
    return model


def _inputs_to(device: torch.device, _: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    torch.cuda.set_device(device)  # the layer's work on its GPU's handles and stream (back below)
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (args, kwargs))


def _output_to(device: torch.device, _: nn.Module, _args: tuple, output: Any) -> Any:
    """The hidden states (a layer's output, or its first) back on the first device; the rest
    stays for the next layer."""
    torch.cuda.set_device(device)
    if isinstance(output, torch.Tensor):
        return output.to(device)
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return type(output)([output[0].to(device), *output[1:]])
    return output
