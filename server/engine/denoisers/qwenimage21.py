"""Qwen-Image 2.1's transformer (`diffusers.QwenImage21Transformer2DModel`) as blocks.

One stream of single-stream blocks over a joint sequence: the prompt's Qwen3-VL tokens, an edit's
condition images' latent tokens in the slots the vision-language encoder reserved for them (each
slot a 2x2 group of latent tokens), then the image being made (the target). Attention is
block-causal: the sequence is causal, each image block bidirectional within itself. Every block
reads one shared modulation (`modulation`, made once a call in `embed`); the prefix (everything
before the target) is modulated from timestep 0 (`causal_condition`).

So the prefix never sees the target, and its keys and values are the same at every step: the
prefix KV cache. Here it is split off as a stream of its own. A request's first call runs the
prefix (`prefix`, block-causal within itself, `BLOCK_MASK`) beside its target tokens, which
attend over [prefix keys, their own]; the walker hands what each block made of the prefix back
(`held`: its keys and values, `PREFIX_KV`, with `PREFIX_MASK` and the target's rotary
`IMAGE_ROTARY`), the request keeps them with its rows, and every later call runs only the target
tokens against them. This is diffusers' extract/cached pair, whatever steps the pipeline caches
on, and it composes with step batching by padding: rows whose prefixes differ in length share a
call, each row's padding masked out of its keys (`PREFIX_MASK`), and each row's target at the
positions its own prefix puts it (`IMAGE_ROTARY`). The kept keys and values are padded to a
multiple of `PREFIX_BUCKET` tokens, so requests of similar prompts share calls.

A request's first call runs apart from cached ones (its rows carry other inputs: another group)
and whole on one device: its block-causal mask is not a mask of keys, which is all a sequence
group's attention takes (`SequenceSplit.splits`). Cached calls split their target tokens and the
prefix's keys alike over a sequence group, whose attention gathers both.

Positions are 3-axis rotary (frame, height, width) from `pos_embed` (`QwenImage21Rope`), made on
the host per row as the transformer makes them for a lone sample.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from server.engine.denoisers.blocks import (
    IMAGE_SLOTS,
    REFERENCE_SHAPES,
    REFERENCES,
    TEXT_MASK,
    Block,
    BlockCall,
    CacheBoundary,
    DenoiserInputs,
    Flow,
    Layout,
    SequenceSplit,
    flow_timesteps,
)
from server.engine.denoisers.dit import token_rows

# What a request keeps after its first call: [rows, layers, 2, P, heads, head_dim] keys and values
# of its prefix (post-norm, post-rotary), [rows, P] 1 where a prefix token is real, and its target
# tokens' rotary frequencies [rows, T, head_dim / 2, 2] (real, imaginary)
PREFIX_KV = "prefix_kv"
PREFIX_MASK = "prefix_mask"
IMAGE_ROTARY = "image_rotary"
PREFIX_BUCKET = 64
SLOT_TOKENS = 4  # latent tokens an image slot stands for (`_IMG_TOKENS_PER_SLOT`)
EXAMPLE_PREFIX = 256  # the planner's cached call: a prompt of this many tokens
HELD = (PREFIX_KV, PREFIX_MASK, IMAGE_ROTARY)
TAKES = (TEXT_MASK, IMAGE_SLOTS, REFERENCES, REFERENCE_SHAPES, *HELD)


class QwenImage21TransformerSpec:
    """`diffusers.QwenImage21Transformer2DModel` (Qwen-Image 2.1 and its Turbo)."""

    EMBEDDING = ("pos_embed", "time_text_embed", "txt_in", "img_in", "modulation")
    OUTPUT = ("norm_out", "proj_out")

    def native_latent(self, model: nn.Module) -> int:
        return 64  # output_resolution 1024: 64 tokens a side (16 px a token)

    def layout(self, model: nn.Module) -> Layout:
        blocks = [Block("embed", self.EMBEDDING)]
        blocks += [Block(f"transformer_blocks.{i}", (f"transformer_blocks.{i}",)) for i in _layers(model)]
        blocks.append(Block("out", self.OUTPUT))
        return Layout(tuple(blocks))

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        """A cached call (every step but a request's first): a prompt's kept keys and values."""
        config = model.config
        sample = torch.randn(batch, config.in_channels, latent_size, latent_size, dtype=dtype, device=device)
        heads, dim = config.num_attention_heads, config.attention_head_dim
        layers = config.num_layers
        kv = torch.randn(batch, layers, 2, EXAMPLE_PREFIX, heads, dim, dtype=dtype, device=device)
        rotary = torch.randn(batch, latent_size * latent_size, dim // 2, 2, device=device)
        held = {
            PREFIX_KV: kv,
            PREFIX_MASK: torch.ones(batch, EXAMPLE_PREFIX, device=device),
            IMAGE_ROTARY: rotary,
        }
        context = torch.randn(batch, 1, config.context_in_dim, dtype=dtype, device=device)
        return DenoiserInputs(sample, flow_timesteps(batch, device), context, held)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(inputs, TAKES, "Qwen-Image 2.1")
        sample = rows.pop("sample")
        h, w = sample.shape[-2:]
        # QwenImage21PrepareLatentsStep's packing (no patches: a token per latent pixel), contiguous
        # as compiled graphs take a padded call's strides
        flow = {
            "hidden": sample.flatten(2).transpose(1, 2).contiguous(),
            # the pipeline passes (t / 1000) in the latents' dtype
            "timestep": rows.pop("timestep").to(sample.dtype) / 1000,
            "layer": torch.zeros(sample.shape[0], dtype=torch.int64, device=sample.device),
        }
        if PREFIX_KV in rows:  # cached: the target tokens against the kept prefix
            flow |= {key: rows[key] for key in HELD}
            flow[PREFIX_MASK] = flow[PREFIX_MASK].to(torch.bool)
        else:
            flow |= prefix_rows(model, rows, h, w)
        return Flow(flow, {"size": (h, w)})

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        calls.update(
            (f"transformer_blocks.{i}", BlockCall(b, joint)) for i, b in enumerate(model.transformer_blocks)
        )
        calls["out"] = BlockCall(model, out)
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        (h, w), hidden = flow.shared["size"], flow.rows["hidden"]
        return hidden.transpose(1, 2).reshape(hidden.shape[0], -1, h, w)

    def held(self, model: nn.Module, flow: Flow) -> dict[str, torch.Tensor]:
        """What a request's first call leaves its rows to keep (nothing after a cached call): the
        prefix's keys and values of every block, padded to a multiple of PREFIX_BUCKET tokens."""
        made = flow.rows.get("made")
        if made is None:
            return {}
        kv, mask = torch.stack(made, dim=1), flow.rows[PREFIX_MASK]
        pad = -kv.shape[3] % PREFIX_BUCKET
        return {
            PREFIX_KV: F.pad(kv, (0, 0, 0, 0, 0, pad)),
            PREFIX_MASK: F.pad(mask, (0, pad)).to(kv.dtype),
            IMAGE_ROTARY: flow.rows[IMAGE_ROTARY],
        }

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        """First-Block-Cache on the target tokens: after the first block, the others are deep.
        A request's first call refreshes every row (nothing kept yet), so its prefix runs whole."""
        blocks = len(model.transformer_blocks)
        if blocks < 2:
            return None
        return CacheBoundary(
            ("transformer_blocks.1", f"transformer_blocks.{blocks - 1}"),
            "hidden",
            "residual",
            first="transformer_blocks.0",
            after=("hidden", "temb", "made", PREFIX_MASK, IMAGE_ROTARY),
        )

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Cached calls: every block on a slice of the target tokens and of the prefix's keys."""
        blocks = frozenset(f"transformer_blocks.{i}" for i in _layers(model))
        tokens = {"hidden": 1, IMAGE_ROTARY: 1, PREFIX_KV: 3, PREFIX_MASK: 1}
        return SequenceSplit(blocks, tokens, splits=lambda inputs: PREFIX_KV in inputs.conditioning)


def _layers(model: nn.Module) -> range:
    return range(len(model.transformer_blocks))


def prefix_rows(model: nn.Module, rows: dict[str, Any], h: int, w: int) -> dict[str, Any]:
    """A first call's prefix, per row as the transformer lays out a lone sample: where each
    prefix token comes from (`source`: a Qwen3-VL token, or a condition image's latent token),
    its rotary frequencies and block-causal mask, and the target's rotary frequencies, padded to
    the call's longest prefix. Host work, once a request."""
    context = rows.pop("context")
    count, width, device = context.shape[0], context.shape[1], context.device
    valid = rows.pop(TEXT_MASK, None)
    valid = torch.ones(count, width) if valid is None else valid.to("cpu", torch.bool)
    slots = rows.pop(IMAGE_SLOTS, None)
    slots = torch.zeros(count, width, dtype=torch.bool) if slots is None else slots.to("cpu", torch.bool)
    references, shapes = rows.pop(REFERENCES, None), rows.pop(REFERENCE_SHAPES, None)
    target = h * w
    laid = []
    for row in range(count):
        used = int(valid[row].sum())
        images = [] if shapes is None else [(1, int(a), int(b)) for a, b in shapes[row].tolist()]
        laid.append(_lay_out(model, slots[row, :used], [*images, (1, h, w)], target, width, device))
    longest = max(len(r["source"]) for r in laid)
    source = torch.zeros(count, longest, dtype=torch.int64)
    mask = torch.zeros(count, longest, dtype=torch.bool)
    allowed = torch.zeros(count, 1, longest, longest, dtype=torch.bool)
    rotary = torch.zeros(count, longest, laid[0]["rotary"].shape[-1], dtype=torch.complex64, device=device)
    for row, r in enumerate(laid):
        n = len(r["source"])
        source[row, :n], mask[row, :n], allowed[row, 0, :n, :n] = r["source"], True, r["allowed"]
        allowed[row, 0, n:, n:] = torch.eye(longest - n, dtype=torch.bool)  # padding: itself (no NaN)
        rotary[row, :n] = r["rotary"][:n]
    prefix = {"context": context, "source": source.to(device)}
    if references is not None:
        prefix["references"] = references
    return prefix | {
        PREFIX_MASK: mask.to(device),
        "block_mask": allowed.to(device),
        "prefix_rotary": torch.view_as_real(rotary),
        IMAGE_ROTARY: torch.view_as_real(torch.stack([r["rotary"][len(r["source"]) :] for r in laid])),
    }


def _lay_out(
    model: nn.Module,
    slots: torch.Tensor,
    shapes: list[tuple[int, int, int]],
    target: int,
    width: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One row's joint sequence as QwenImage21Transformer2DModel.forward lays it out: its
    Qwen3-VL tokens with each image slot expanded to 4 latent tokens, then the target's."""
    vlm = torch.cat([slots, torch.ones(target // SLOT_TOKENS, dtype=torch.bool)])
    repeats = torch.where(vlm, SLOT_TOKENS, 1)
    image = torch.repeat_interleave(vlm, repeats)
    rotary = model.pos_embed(shapes, image.to(device), device=device)
    ids, _ = model.build_token_metadata(image, shapes)
    prefix = len(image) - target
    ids, image = ids[:prefix], image[:prefix]
    # a text token's source is its Qwen3-VL position; an image token's, its condition token after them
    text = torch.repeat_interleave(torch.arange(len(slots)), repeats[: len(slots)])
    source = torch.where(image, width + torch.cumsum(image, 0) - 1, text)
    at = torch.arange(prefix)
    same_image = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    return {"source": source, "rotary": rotary, "allowed": (at[:, None] >= at[None, :]) | same_image}


# The blocks' calls: fn(owner, rows, shared) → rows, as QwenImage21Transformer2DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """The target's tokens and modulation (from its timestep); on a first call, the prefix's
    tokens and modulation (from timestep 0, `causal_condition`)."""
    hidden = model.img_in(rows["hidden"])
    temb = model.time_text_embed(rows["timestep"], hidden)
    keep = (PREFIX_KV, PREFIX_MASK, IMAGE_ROTARY, "block_mask", "prefix_rotary", "layer")
    out = {"hidden": hidden, "temb": temb, "mod": model.modulation(temb)}
    out |= {key: rows[key] for key in keep if key in rows}
    if "source" in rows:  # a Qwen3-VL token's source is its position; a condition token's, after them
        tokens = model.txt_in(rows["context"])
        if "references" in rows:
            tokens = torch.cat([tokens, model.img_in(rows["references"])], dim=1)
        source = rows["source"]
        out["prefix"] = tokens.gather(1, source[..., None].expand(-1, -1, tokens.shape[-1]))
        zero = model.time_text_embed(rows["timestep"].new_zeros(1), hidden)
        out["mod0"] = model.modulation(zero).expand(hidden.shape[0], -1)
    return out


def joint(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """A block: on a first call the prefix's tokens (block-causal) and its keys and values kept
    (`made`), else this block's kept ones (`layer` counts the blocks run); then the target's
    tokens over [prefix keys, their own]."""
    out = {**rows, "layer": rows["layer"] + 1}
    if PREFIX_KV in rows:
        keys, values = rows[PREFIX_KV].index_select(1, rows["layer"][:1]).squeeze(1).unbind(1)
    else:
        prefix, keys, values = _stream(
            block, rows["prefix"], rows["mod0"], rows["prefix_rotary"], None, None, rows["block_mask"]
        )
        out["prefix"] = prefix
        out["made"] = (*rows.get("made", ()), torch.stack([keys, values], dim=1))
    out["hidden"], _, _ = _stream(
        block, rows["hidden"], rows["mod"], rows[IMAGE_ROTARY], keys, values, rows[PREFIX_MASK]
    )
    return out


def out(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """The target's prediction; a first call's prefix keys and values passed on (`held`)."""
    kept = {key: rows[key] for key in ("made", PREFIX_MASK, IMAGE_ROTARY) if "made" in rows}
    return kept | {"hidden": model.proj_out(model.norm_out(rows["hidden"], rows["temb"]))}


def _stream(
    block: nn.Module,
    hidden: torch.Tensor,
    modulation: torch.Tensor,
    rotary: torch.Tensor,
    prefix_keys: torch.Tensor | None,
    prefix_values: torch.Tensor | None,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QwenImage21TransformerBlock.forward on one stream's tokens [rows, S, dim] with its
    modulation [rows, 4·dim]: over its own keys under `mask` ([rows, 1, S, S] pairs), or over
    [`prefix_keys`, its own] with `mask` the prefix's keys ([rows, P]). Returns the tokens and
    their keys and values."""
    (scale1, gate1), (scale2, gate2) = (m.chunk(2, dim=-1) for m in modulation.chunk(2, dim=-1))
    attn = block.attn
    normed = block.img_norm1(hidden) * (1 + scale1[:, None])
    query, key, value = (_heads(attn, layer(normed)) for layer in (attn.to_q, attn.to_k, attn.to_v))
    query, key = attn.norm_q(query).to(value.dtype), attn.norm_k(key).to(value.dtype)
    frequencies = rotary.float()[:, :, None]  # [rows, S, 1, d / 2, (cos, sin)]
    query, key = _rotated(query, frequencies), _rotated(key, frequencies)
    keys, values = key, value
    if prefix_keys is not None:
        keys, values = torch.cat([prefix_keys, key], dim=1), torch.cat([prefix_values, value], dim=1)
        own = mask.new_ones(mask.shape[0], hidden.shape[1])
        mask = torch.cat([mask, own], dim=1)[:, None, None, :]
    attended = F.scaled_dot_product_attention(
        query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
    )
    attended = attn.to_out[1](attn.to_out[0](attended.transpose(1, 2).flatten(2, 3).type_as(query)))
    hidden = hidden + gate1.tanh()[:, None] * attended
    normed = block.img_norm2(hidden) * (1 + scale2[:, None])
    hidden = hidden + gate2.tanh()[:, None] * block.img_mlp(normed)
    if hidden.dtype == torch.float16:
        hidden = hidden.clip(-65504, 65504)
    return hidden, key, value


def _heads(attn: nn.Module, projected: torch.Tensor) -> torch.Tensor:
    return projected.unflatten(-1, (-1, attn.inner_dim // attn.heads))


def _rotated(x: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """apply_rotary_emb_qwen(use_real=False) with a row's own frequencies [rows, S, 1, d/2, 2]:
    its complex product in float32, written out in reals (inductor compiles no complex ops)."""
    real, imaginary = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    cos, sin = frequencies.unbind(-1)
    turned = torch.stack([real * cos - imaginary * sin, real * sin + imaginary * cos], dim=-1)
    return turned.flatten(3).type_as(x)
