"""Stable Diffusion 3's MMDiT (`diffusers.SD3Transformer2DModel`) as blocks.

forward runs three embeddings first: `pos_embed` patchifies the latent and adds the
(cropped) sin-cos positions, `time_text_embed` turns the timestep and the pooled CLIP
projections into `temb`, `context_embedder` projects the text context; an IP-Adapter's
`image_proj`, when one is loaded, runs there too. They form the `embed` block. Then each
`transformer_blocks.{i}` maps (image tokens, text tokens, temb) to the next pair: one block
each. `norm_out` (modulated by temb) and `proj_out` end it, then forward unpatchifies
outside any module. There are no skip residuals: only the two token streams and `temb`
cross a boundary, and `temb` crosses every one.

Each block's call is a few lines of `SD3Transformer2DModel.forward` (diffusers 0.42) for the
inputs the family passes (`pooled_projections`); skip layers, controlnet states and IP-Adapter
embeddings are refused by name. Step caching cuts it after the first block: `first_block`
(First-Block-Cache) measures the change of the first block's residual; the blocks after it run
only on refreshing rows, and a reusing row adds the residual they made at its last refresh.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import (
    BlockCall,
    CacheBoundary,
    Cut,
    DenoiserInputs,
    Flow,
    Layout,
    SequenceSplit,
    TensorSplit,
    flow_timesteps,
    present,
    stacked_layout,
)

CLIP_TOKENS = 77  # both CLIP encoders' hidden states, side by side in the channels
T5_TOKENS = 256  # StableDiffusion3Pipeline's default max_sequence_length; zeros without text_encoder_3


CONTROL = {"block_controlnet_hidden_states": "transformer_blocks"}  # an MMDiT ControlNet's residuals


class SD3TransformerSpec:
    """`diffusers.SD3Transformer2DModel`: SD 3 and 3.5 (dual attention, qk norm) alike."""

    EMBEDDING = ("pos_embed", "time_text_embed", "context_embedder", "image_proj")
    OUTPUT = ("norm_out", "proj_out")

    def layout(self, model: nn.Module) -> Layout:
        embed, out = present(model, self.EMBEDDING), present(model, self.OUTPUT)
        return stacked_layout(model, embed, ("transformer_blocks",), out)

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        size = (batch, config.in_channels, latent_size, latent_size)
        sample = torch.randn(size, dtype=dtype, device=device)
        timestep = flow_timesteps(batch, device)
        tokens = CLIP_TOKENS + T5_TOKENS
        context = torch.randn(batch, tokens, config.joint_attention_dim, dtype=dtype, device=device)
        pooled = torch.randn(batch, config.pooled_projection_dim, dtype=dtype, device=device)
        conditioning: dict[str, Any] = {"pooled_projections": pooled}
        return DenoiserInputs(sample, timestep, context, conditioning)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(inputs, ("pooled_projections", *CONTROL), "MMDiT")
        if samples := rows.get("block_controlnet_hidden_states"):  # as forward adds them: block i
            blocks = model.transformer_blocks  # sample int(i / (blocks / samples)), but the last
            interval = len(blocks) / len(samples)  # block's (its context is not carried on)
            rows["block_controlnet_hidden_states"] = tuple(
                None if b.context_pre_only else samples[int(i / interval)] for i, b in enumerate(blocks)
            )
        return Flow(rows, {"size": tuple(inputs.sample.shape[-2:])})

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        calls.update(
            (f"transformer_blocks.{i}", BlockCall(b, joint)) for i, b in enumerate(model.transformer_blocks)
        )
        calls["out"] = BlockCall(model, out)
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        hidden, (height, width) = flow.rows["hidden"], flow.shared["size"]
        p = model.config.patch_size
        hidden = hidden.reshape(hidden.shape[0], height // p, width // p, p, p, model.out_channels)
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(hidden.shape[0], model.out_channels, height, width)

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        return dit_boundary(model.transformer_blocks, "transformer_blocks")

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Each transformer block on a slice of the image tokens and of the text tokens."""
        blocks = frozenset(f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks)))
        return SequenceSplit(blocks, {**TOKENS, **dict.fromkeys(CONTROL, 1)})

    def tensor(self, model: nn.Module) -> TensorSplit:
        """Each joint block's attention (both streams, and the 3.5 models' second attention) by
        heads, its MLPs, and its AdaLN modulation gathered; as diffusers splits FLUX.1's (this
        MMDiT's class declares no `_tp_plan`)."""
        blocks = "transformer_blocks.*"
        cuts = {f"{blocks}.{a}.{p}": Cut.COLUMN for a in ("attn", "attn2") for p in QKV}
        cuts |= {f"{blocks}.{a}.to_out.0": Cut.ROW for a in ("attn", "attn2")}
        cuts |= {f"{blocks}.attn.to_add_out": Cut.ROW}
        for ff in ("ff", "ff_context"):
            cuts |= {f"{blocks}.{ff}.net.0.proj": Cut.COLUMN, f"{blocks}.{ff}.net.2": Cut.ROW}
        cuts |= {f"{blocks}.{n}.linear": Cut.GATHERED for n in ("norm1", "norm1_context")}
        return TensorSplit(self.sequence(model).blocks, cuts)


QKV = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")

TOKENS = {"hidden": 1, "context": 1}  # a DiT's image and text tokens: [rows, tokens, features]


def token_rows(inputs: DenoiserInputs, takes: tuple[str, ...], family: str) -> dict[str, Any]:
    """A DiT call's rows: its sample, [rows] timesteps (a scalar broadcast, as pipelines
    `t.expand(batch)`), context and the conditioning it takes; anything else is refused."""
    unknown = sorted(k for k, v in inputs.conditioning.items() if v is not None and k not in takes)
    if unknown:
        raise ValueError(f"the {family} block walk does not take {', '.join(unknown)}")
    sample = inputs.sample
    timestep = torch.as_tensor(inputs.timestep, device=sample.device)
    timestep = (
        timestep if timestep.ndim == 2 else timestep.expand(sample.shape[0])
    )  # [rows, frames]: Wan 2.2's
    rows = {"sample": sample, "timestep": timestep, "context": inputs.context}
    rows.update((k, v) for k, v in inputs.conditioning.items() if v is not None)
    return rows


def dit_boundary(blocks: nn.ModuleList, name: str, last: str | None = None) -> CacheBoundary | None:
    """A DiT's cut after its first block: the blocks after it are the deep part (through `last`)."""
    if len(blocks) < 2 and last is None:
        return None
    end = last or f"{name}.{len(blocks) - 1}"
    return CacheBoundary(
        (f"{name}.1", end), "hidden", "residual", first=f"{name}.0", after=("hidden", "temb")
    )


# The blocks' calls: fn(owner, rows, shared) → rows, as SD3Transformer2DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hidden = model.pos_embed(rows["sample"]).contiguous()
    temb = model.time_text_embed(rows["timestep"], rows["pooled_projections"])
    out = {"hidden": hidden, "temb": temb, "context": model.context_embedder(rows["context"])}
    return carried(out, rows, CONTROL)


def joint(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    context, hidden = block(
        hidden_states=rows["hidden"], encoder_hidden_states=rows["context"], temb=rows["temb"]
    )
    out = {"hidden": hidden, "temb": rows["temb"], "context": context}
    return controlled(out, rows, "block_controlnet_hidden_states", CONTROL)


# A ControlNet's residuals, laid out one a block by `begin` (None: a block that takes none), so
# the blocks of a stream keep one function (and one compiled graph): each takes the first.


def carried(out: dict[str, Any], rows: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """`out` with the residuals of `keys` that `rows` carries, passed on."""
    return {**out, **{key: rows[key] for key in keys if key in rows}}


def controlled(out: dict[str, Any], rows: dict[str, Any], key: str, keys: Iterable[str]) -> dict[str, Any]:
    """A block's output with its residual of `key` added to the image stream, the rest passed on."""
    out = carried(out, rows, keys)
    if samples := out.pop(key, None):
        if samples[0] is not None:
            out["hidden"] = out["hidden"] + samples[0]
        if samples[1:]:
            out[key] = samples[1:]
    return out


def out(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return {"hidden": model.proj_out(model.norm_out(rows["hidden"], rows["temb"]))}
