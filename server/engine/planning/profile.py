"""Measured forward time per block: the weights the `cost` strategy balances.

A UNet's blocks differ by an order of magnitude in cost at the same parameter bytes
(high-resolution attention is cheap in weights and dear in time), so balancing bytes
leaves one stage the bottleneck.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from server.engine.denoisers.blocks import block_modules, walk_plain
from server.engine.denoisers.specs import spec_for
from server.engine.planning.flow import as_loaded


def profile_block_costs(
    model: nn.Module,
    batch: int,
    latent_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    repeats: int = 3,
) -> dict[str, float]:
    """Median seconds each block spends in forward on `device` over `repeats` runs after one warm-up.

    Unless the model's weights already sit on `device` in `dtype`, a twin with random weights
    (seed 0) is built there: time depends on shapes, not on the values of the weights, and a
    split for GPUs must not be balanced with CPU timings.
    """
    weight = next(model.parameters())
    if weight.is_meta or weight.device != torch.device(device) or weight.dtype != dtype:
        model = random_twin(model, dtype, device)
    spec = spec_for(model)
    cuda = torch.device(device) if torch.device(device).type == "cuda" else None
    sync = (lambda: torch.cuda.synchronize(cuda)) if cuda is not None else (lambda: None)
    spent: dict[str, float] = {}
    started: dict[int, float] = {}

    def before(module: nn.Module, _args: tuple) -> None:
        sync()
        started[id(module)] = time.perf_counter()

    def after(name: str):
        def hook(module: nn.Module, _args: tuple, _output: object) -> None:
            sync()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started.pop(id(module))

        return hook

    handles = []
    for name, module in block_modules(model, spec.layout(model)):
        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after(name))]
    runs: list[dict[str, float]] = []
    try:
        inputs = spec.example_inputs(model, batch, latent_size, dtype, torch.device(device))
        with torch.inference_mode():
            for _ in range(repeats + 1):
                spent.clear()
                walk_plain(spec, model, inputs)
                runs.append(dict(spent))
    finally:
        for handle in handles:
            handle.remove()
    return {name: statistics.median(run[name] for run in runs[1:]) for name in runs[0]}


@torch.no_grad()
def random_twin(model: nn.Module, dtype: torch.dtype, device: str) -> nn.Module:
    """The same architecture on `device` in `dtype` with random weights (seed 0): built on the
    meta device and only then given memory, so a GPU never holds a float32 copy first."""
    with torch.device("meta"):
        twin = type(model).from_config(model.config)
    twin = as_loaded(twin, dtype).to_empty(device=device).eval()
    generator = torch.Generator(device).manual_seed(0)
    for tensor in (*twin.parameters(), *twin.buffers()):
        if tensor.is_floating_point():  # small values: no overflow, no denormals to slow the timing
            tensor.normal_(0.0, 0.02, generator=generator)
    return twin
