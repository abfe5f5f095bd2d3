"""Step caching inside one batched forward: the denoiser's blocks walked in the order its own
forward runs them, with the rows split at the cache boundary.

Rows come in groups (one request's rows: its negative and prompt rows decide together, as they
would in a pipeline of its own). A group either refreshes (runs every block; what it made at the
boundary goes back to the caller to keep) or reuses what it kept. The deep part runs once, on the
refreshing rows only (`subset` wraps that call: the caller narrows its per-row state, e.g. LoRA
rows, to them), so a step whose rows all reuse never calls a deep block, and never enters a
ModelShard stage that holds only deep blocks.

- UNet, `deep` (DeepCache, arXiv:2312.00858, its shallowest branch): shallow = embeddings,
  conv_in, down_blocks[0], up_blocks[-1], out; kept = up_blocks[-2]'s output.
- MMDiT (`SD3Transformer2DModel`), `first_block` (First-Block-Cache): shallow = embeddings,
  transformer_blocks[0], out; kept = the first block's residual (to measure change against) and
  the rest's residual.

Both walks replay diffusers' forward for the inputs the families pass; anything else (masks,
controlnet residuals, skip layers, IP adapters) makes `walk_for` return None and the caller runs
the plain forward with every row refreshing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import SD3Transformer2DModel, UNet2DConditionModel
from torch import nn

from server.engine.blocks import DenoiserInputs
from server.engine.unet import unet_skips

Subset = Callable[[list[int]], AbstractContextManager[Any]]  # wraps the deep part's rows


@dataclass
class RowGroup:
    """One request's rows in a cached call: what it asks and, after the call, what happened."""

    rows: slice
    kept: dict[str, torch.Tensor] | None  # its features from the last refresh; None: must refresh
    refresh: bool = True  # deep: the caller decides; first_block: forced if True, else by threshold
    threshold: float = 0.0  # first_block: relative change of the first block's residual
    fresh: dict[str, torch.Tensor] = field(default_factory=dict)  # set on refresh: views to keep

    @property
    def count(self) -> int:
        return self.rows.stop - self.rows.start


def no_subset(_rows: list[int]) -> AbstractContextManager[Any]:
    return nullcontext()


def walk_for(model: nn.Module, inputs: DenoiserInputs) -> Callable[..., torch.Tensor] | None:
    """The cached walk for `model` called with `inputs`, or None where only the plain forward can
    run them (the caller then refreshes every row)."""
    if isinstance(model, UNet2DConditionModel) and _unet_supported(model, inputs.conditioning):
        return unet_deep
    if isinstance(model, SD3Transformer2DModel) and _sd3_supported(model, inputs.conditioning):
        return sd3_first_block
    return None


def _refreshing(groups: Sequence[RowGroup]) -> list[int]:
    return [row for g in groups if g.refresh for row in range(g.rows.start, g.rows.stop)]


def _rows_of(tensor: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor`'s rows in `index` (all of them when index is None)."""
    if tensor is None or index is None:
        return tensor
    return tensor.index_select(0, index.to(tensor.device))


def _assemble(groups: Sequence[RowGroup], fresh: torch.Tensor | None, name: str) -> torch.Tensor:
    """Every group's rows in order: refreshing groups' from `fresh` (their rows, in order), the
    others' kept `name`. Each refreshing group gets its slice of `fresh` to keep."""
    pieces, at = [], 0
    for g in groups:
        if g.refresh:
            g.fresh[name] = piece = fresh[at : at + g.count]
            at += g.count
        else:
            piece = g.kept[name]
        pieces.append(piece)
    if all(g.refresh for g in groups):
        return fresh
    device = pieces[0].device if fresh is None else fresh.device
    return torch.cat([p.to(device) for p in pieces])


# UNet: DeepCache at the shallowest branch.

_UNET_TAKES = {"added_cond_kwargs", "timestep_cond", "class_labels"}


def _unet_supported(model: nn.Module, conditioning: dict[str, Any]) -> bool:
    if any(v is not None for k, v in conditioning.items() if k not in _UNET_TAKES):
        return False  # masks, controlnet/adapter residuals, cross_attention_kwargs
    if model.config.addition_embed_type == "image_hint" or len(model.up_blocks) < 2:
        return False
    last = f"up_blocks.{len(model.up_blocks) - 1}"  # its residuals must all be shallow
    return {edge.source for edge in unet_skips(model) if edge.target == last} <= {"conv_in", "down_blocks.0"}


def _down(block: nn.Module, h: torch.Tensor, emb: torch.Tensor, context: torch.Tensor) -> tuple:
    if getattr(block, "has_cross_attention", False):
        return block(hidden_states=h, temb=emb, encoder_hidden_states=context)
    return block(hidden_states=h, temb=emb)


def _up(block: nn.Module, h, emb, context, residuals: tuple, size) -> torch.Tensor:
    if getattr(block, "has_cross_attention", False):
        return block(
            hidden_states=h,
            temb=emb,
            res_hidden_states_tuple=residuals,
            encoder_hidden_states=context,
            upsample_size=size,
        )
    return block(hidden_states=h, temb=emb, res_hidden_states_tuple=residuals, upsample_size=size)


def unet_deep(
    model: UNet2DConditionModel,
    inputs: DenoiserInputs,
    groups: Sequence[RowGroup],
    subset: Subset = no_subset,
) -> torch.Tensor:
    """UNet2DConditionModel.forward (diffusers 0.42) with the deep part on refreshing rows only."""
    sample, timestep, context = inputs.sample, inputs.timestep, inputs.context
    cond = inputs.conditioning
    forward_upsample_size = any(side % 2**model.num_upsamplers for side in sample.shape[-2:])
    if model.config.center_input_sample:
        sample = 2 * sample - 1.0
    # 1. Shallow, every row: embeddings, conv_in, the first down block.
    t_emb = model.get_time_embed(sample=sample, timestep=timestep)
    emb = model.time_embedding(t_emb, cond.get("timestep_cond"))
    class_emb = model.get_class_embed(sample=sample, class_labels=cond.get("class_labels"))
    if class_emb is not None:
        emb = torch.cat([emb, class_emb], dim=-1) if model.config.class_embeddings_concat else emb + class_emb
    added = cond.get("added_cond_kwargs")
    aug = model.get_aug_embed(emb=emb, encoder_hidden_states=context, added_cond_kwargs=added)
    emb = emb + aug if aug is not None else emb
    if model.time_embed_act is not None:
        emb = model.time_embed_act(emb)
    context = model.process_encoder_hidden_states(encoder_hidden_states=context, added_cond_kwargs=added)
    h = model.conv_in(sample)
    stack = (h,)  # the skip residuals, as forward stacks them
    h, made = _down(model.down_blocks[0], h, emb, context)
    stack += made
    last = model.up_blocks[-1]
    shallow, deep_in = stack[: len(last.resnets)], stack[len(last.resnets) :]
    # 2. Deep, refreshing rows only: the other down blocks, the mid block, all but the last up block.
    rows = _refreshing(groups)
    fresh = None
    if rows:
        index = None if len(rows) == sample.shape[0] else torch.tensor(rows)
        d_emb, d_context = _rows_of(emb, index), _rows_of(context, index)
        d_h, deep_stack = _rows_of(h, index), tuple(_rows_of(r, index) for r in deep_in)
        with subset(rows):
            for block in model.down_blocks[1:]:
                d_h, made = _down(block, d_h, d_emb, d_context)
                deep_stack += made
            if model.mid_block is not None:
                if getattr(model.mid_block, "has_cross_attention", False):
                    d_h = model.mid_block(d_h, d_emb, encoder_hidden_states=d_context)
                else:
                    d_h = model.mid_block(d_h, d_emb)
            for block in model.up_blocks[:-1]:
                taken, deep_stack = deep_stack[-len(block.resnets) :], deep_stack[: -len(block.resnets)]
                below = (*shallow, *deep_stack)  # what forward's stack holds after the pop
                size = below[-1].shape[2:] if forward_upsample_size else None
                d_h = _up(block, d_h, d_emb, d_context, taken, size)
        fresh = d_h
    # 3. Shallow again, every row: the last up block on the fresh or kept features, then out.
    h = _assemble(groups, fresh, "deep")
    h = _up(last, h, emb, context, shallow, None)
    if model.conv_norm_out is not None:
        h = model.conv_act(model.conv_norm_out(h))
    return model.conv_out(h)


# MMDiT (SD3Transformer2DModel): First-Block-Cache.


def _sd3_supported(model: nn.Module, conditioning: dict[str, Any]) -> bool:
    others = {k: v for k, v in conditioning.items() if k != "pooled_projections"}
    return len(model.transformer_blocks) >= 2 and all(v is None for v in others.values())


def _change(now: torch.Tensor, before: torch.Tensor) -> float:
    """Relative mean absolute change of a residual since the last refresh."""
    return float((now - before).abs().mean() / before.abs().mean().clamp_min(1e-12))


def sd3_first_block(
    model: SD3Transformer2DModel,
    inputs: DenoiserInputs,
    groups: Sequence[RowGroup],
    subset: Subset = no_subset,
) -> torch.Tensor:
    """SD3Transformer2DModel.forward (diffusers 0.42) with the blocks after the first run only on
    rows whose first-block residual moved by `threshold` or more since their last refresh."""
    sample = inputs.sample
    height, width = sample.shape[-2:]
    timestep = torch.as_tensor(inputs.timestep, device=sample.device)
    if timestep.ndim == 0:
        timestep = timestep.expand(sample.shape[0])
    hidden = model.pos_embed(sample).contiguous()
    temb = model.time_text_embed(timestep, inputs.conditioning.get("pooled_projections"))
    context = model.context_embedder(inputs.context)
    first, *rest = model.transformer_blocks
    context, after = first(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
    residual = after - hidden
    for g in groups:  # a group refreshes when asked, when it has nothing kept, or when it moved
        if not g.refresh:
            g.refresh = _change(residual[g.rows], g.kept["first"].to(residual.device)) >= g.threshold
        if g.refresh:
            g.fresh["first"] = residual[g.rows]
    rows = _refreshing(groups)
    fresh = None
    if rows:
        index = None if len(rows) == sample.shape[0] else torch.tensor(rows)
        d_h, d_context, d_temb = (_rows_of(t, index) for t in (after, context, temb))
        with subset(rows):
            for block in rest:
                d_context, d_h = block(hidden_states=d_h, encoder_hidden_states=d_context, temb=d_temb)
        fresh = d_h - _rows_of(after, index).to(d_h.device)
    kept = _assemble(groups, fresh, "rest")
    hidden = d_h if all(g.refresh for g in groups) else after + kept.to(after.device)
    hidden = model.proj_out(model.norm_out(hidden, temb))
    p = model.config.patch_size
    hidden = hidden.reshape(hidden.shape[0], height // p, width // p, p, p, model.out_channels)
    hidden = torch.einsum("nhwpqc->nchpwq", hidden)
    return hidden.reshape(hidden.shape[0], model.out_channels, height, width)
