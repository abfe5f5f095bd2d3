"""`diffusers.UNet2DConditionModel` as blocks: time embedding, conv_in, down blocks, mid block,
up blocks, out, with the skip residuals each up block takes from the down path.

Each block's call is a few lines of `UNet2DConditionModel.forward` (diffusers 0.42) for the
conditioning the families pass (`added_cond_kwargs`; `timestep_cond` and `class_labels`) and a
ControlNet's residuals (`down_block_additional_residuals`, `mid_block_additional_residual`,
as forward takes them: zeros on rows without a control); masks and cross-attention kwargs are
refused by name. The flow's rows carry `h`, the embedding `emb`, the `context` and `stack`, the
skip residuals as forward stacks them, and a control's residuals, added where they are used.
Step caching (DeepCache, arXiv:2312.00858, its shallowest branch) cuts it where the deep part
starts (`down_blocks.1`) and ends (the second-to-last up block); a reusing row takes
that block's kept output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import (
    Block,
    BlockCall,
    CacheBoundary,
    Cut,
    DenoiserInputs,
    Flow,
    Layout,
    SkipEdge,
    TensorSplit,
    present,
)

CONTROL = ("down_block_additional_residuals", "mid_block_additional_residual")  # a ControlNet's
TAKES = {"added_cond_kwargs", "timestep_cond", "class_labels", *CONTROL}  # the conditioning walked


class UNetSpec:
    """`diffusers.UNet2DConditionModel`, with or without added conditioning (`added_cond_kwargs`)."""

    # Modules forward runs before conv_in: timestep, class, added and context embeddings.
    EMBEDDING = (
        "time_proj",
        "time_embedding",
        "class_embedding",
        "add_time_proj",
        "add_embedding",
        "time_embed_act",
        "encoder_hid_proj",
        "position_net",
    )
    OUTPUT = ("conv_norm_out", "conv_act", "conv_out")

    def layout(self, model: nn.Module) -> Layout:
        blocks = [Block("embed", present(model, self.EMBEDDING)), Block("conv_in", ("conv_in",))]
        blocks += [Block(f"down_blocks.{i}", (f"down_blocks.{i}",)) for i in range(len(model.down_blocks))]
        if model.mid_block is not None:
            blocks.append(Block("mid_block", ("mid_block",)))
        blocks += [Block(f"up_blocks.{i}", (f"up_blocks.{i}",)) for i in range(len(model.up_blocks))]
        blocks.append(Block("out", present(model, self.OUTPUT)))
        return Layout(tuple(blocks), unet_skips(model))

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        if not isinstance(config.cross_attention_dim, int):
            raise ValueError("per-block cross_attention_dim is not supported")
        sample = torch.randn(batch, config.in_channels, latent_size, latent_size, dtype=dtype, device=device)
        timestep = torch.arange(batch, device=device) * 7 + 1  # distinct per-sample timesteps
        context = torch.randn(batch, 77, config.cross_attention_dim, dtype=dtype, device=device)
        conditioning: dict[str, Any] = {}
        if config.addition_embed_type == "text_time":  # pooled text embeds + 6 size/crop ids
            text_dim = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            conditioning["added_cond_kwargs"] = {
                "text_embeds": torch.randn(batch, text_dim, dtype=dtype, device=device),
                "time_ids": torch.randn(batch, 6, dtype=dtype, device=device),
            }
        return DenoiserInputs(sample, timestep, context, conditioning)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        unknown = sorted(k for k, v in inputs.conditioning.items() if v is not None and k not in TAKES)
        if unknown:
            raise ValueError(f"the UNet's block walk does not take {', '.join(unknown)}")
        sample = inputs.sample
        if model.config.center_input_sample:
            sample = 2 * sample - 1.0
        timestep = torch.as_tensor(inputs.timestep, device=sample.device)
        rows = {"sample": sample, "timestep": timestep.expand(sample.shape[0]), "context": inputs.context}
        rows.update((k, v) for k, v in inputs.conditioning.items() if v is not None)
        upsample = any(side % 2**model.num_upsamplers for side in sample.shape[-2:])
        return Flow(rows, {"upsample": upsample})

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed), "conv_in": BlockCall(model.conv_in, conv_in)}
        calls.update((f"down_blocks.{i}", BlockCall(b, down)) for i, b in enumerate(model.down_blocks))
        if model.mid_block is not None:
            calls["mid_block"] = BlockCall(model.mid_block, mid)
        calls.update((f"up_blocks.{i}", BlockCall(b, up)) for i, b in enumerate(model.up_blocks))
        calls["out"] = BlockCall(model, out)
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        return flow.rows["h"]

    def sequence(self, model: nn.Module) -> None:
        """A UNet's convolutions mix neighbouring pixels: its tokens cannot be split by blocks."""
        return None

    def tensor(self, model: nn.Module) -> TensorSplit:
        """The transformer blocks inside its down, mid and up blocks: self- and cross-attention by
        heads, the feed-forward's GEGLU (gate and value halves) and output; the convolutions
        (most of a UNet: its Linear layers are about a third of its weights) whole on every rank."""
        blocks = frozenset(
            b.name
            for b in self.layout(model).blocks
            if any(getattr(model.get_submodule(m), "attentions", None) for m in b.modules)
        )
        inside = "*.attentions.*.transformer_blocks.*"
        cuts = {f"{inside}.{a}.{p}": Cut.COLUMN for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")}
        cuts |= {f"{inside}.{a}.to_out.0": Cut.ROW for a in ("attn1", "attn2")}
        cuts |= {f"{inside}.ff.net.0.proj": Cut.PACKED_COLUMN, f"{inside}.ff.net.2": Cut.ROW}
        packed = {f"{inside}.ff.net.0.proj": (1, 1)}  # GEGLU: value, then gate
        return TensorSplit(blocks, cuts, packed)

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        """DeepCache's cut, where the last up block's residuals are all shallow."""
        if model.config.addition_embed_type == "image_hint" or len(model.up_blocks) < 2:
            return None
        if len(model.down_blocks) < 2:
            return None
        last = f"up_blocks.{len(model.up_blocks) - 1}"
        if not {e.source for e in unet_skips(model) if e.target == last} <= {"conv_in", "down_blocks.0"}:
            return None
        deep = ("down_blocks.1", f"up_blocks.{len(model.up_blocks) - 2}")
        left = len(model.up_blocks[-1].resnets)  # the last up block's residuals: all shallow
        return CacheBoundary(deep, "h", "output", stack=("stack", left))


# The blocks' calls: fn(owner, rows, shared) → rows, as UNet2DConditionModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    sample, context = rows["sample"], rows["context"]
    t_emb = model.get_time_embed(sample=sample, timestep=rows["timestep"])
    emb = model.time_embedding(t_emb, rows.get("timestep_cond"))
    class_emb = model.get_class_embed(sample=sample, class_labels=rows.get("class_labels"))
    if class_emb is not None:
        emb = torch.cat([emb, class_emb], dim=-1) if model.config.class_embeddings_concat else emb + class_emb
    added = rows.get("added_cond_kwargs")
    aug = model.get_aug_embed(emb=emb, encoder_hidden_states=context, added_cond_kwargs=added)
    emb = emb + aug if aug is not None else emb
    if model.time_embed_act is not None:
        emb = model.time_embed_act(emb)
    context = model.process_encoder_hidden_states(encoder_hidden_states=context, added_cond_kwargs=added)
    return {"sample": sample, "emb": emb, "context": context, **controls(rows)}


def conv_in(layer: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    h = layer(rows["sample"])
    return {"h": h, "emb": rows["emb"], "context": rows["context"], "stack": (h,), **controls(rows)}


def controls(rows: dict[str, Any]) -> dict[str, Any]:
    """A ControlNet's residuals, carried to where they are added."""
    return {name: rows[name] for name in CONTROL if name in rows}


def down(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    h, emb, context = rows["h"], rows["emb"], rows["context"]
    if getattr(block, "has_cross_attention", False):
        h, made = block(hidden_states=h, temb=emb, encoder_hidden_states=context)
    else:
        h, made = block(hidden_states=h, temb=emb)
    return {**rows, "h": h, "stack": (*rows["stack"], *made)}


def mid(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    if getattr(block, "has_cross_attention", False):
        h = block(rows["h"], rows["emb"], encoder_hidden_states=rows["context"])
    else:
        h = block(rows["h"], rows["emb"])
    if (control := rows.get("mid_block_additional_residual")) is not None:
        h = h + control
    return {**rows, "h": h}


def up(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    stack, count = rows["stack"], len(block.resnets)
    taken, stack = stack[-count:], stack[:-count]
    if (control := rows.get("down_block_additional_residuals")) is not None:
        # the i-th residual forward stacked takes the i-th control residual (a step-cached row's
        # stack holds the shallow ones only: counted from the bottom, they still line up)
        taken = tuple(r + c for r, c in zip(taken, control[len(stack) : len(stack) + count], strict=True))
    size = stack[-1].shape[2:] if shared["upsample"] and stack else None  # the last up block: none
    kwargs = {"hidden_states": rows["h"], "temb": rows["emb"], "res_hidden_states_tuple": taken}
    if getattr(block, "has_cross_attention", False):
        kwargs["encoder_hidden_states"] = rows["context"]
    return {**rows, "h": block(**kwargs, upsample_size=size), "stack": stack}


def out(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    h = rows["h"]
    if model.conv_norm_out is not None:
        h = model.conv_act(model.conv_norm_out(h))
    return {"h": model.conv_out(h)}


def unet_skips(model: nn.Module) -> tuple[SkipEdge, ...]:
    """Which block made each residual an up block consumes.

    forward stacks conv_in's output, then every down block's per-resnet (and downsampler)
    outputs; each up block pops `len(resnets)` residuals off the top of that stack.
    """
    stack = ["conv_in"]
    for i, block in enumerate(model.down_blocks):
        made = len(block.resnets) + (1 if block.downsamplers is not None else 0)
        stack += [f"down_blocks.{i}"] * made
    edges: list[SkipEdge] = []
    for i, block in enumerate(model.up_blocks):
        want = len(block.resnets)
        if want > len(stack):
            raise ValueError(f"up_blocks.{i} consumes {want} residuals but only {len(stack)} remain")
        taken, stack = stack[-want:], stack[:-want]
        for source in dict.fromkeys(reversed(taken)):  # nearest producer first, as forward pops
            edges.append(SkipEdge(source, f"up_blocks.{i}", taken.count(source)))
    if stack:
        raise ValueError(f"{len(stack)} residuals are never consumed by an up block")
    return tuple(edges)
