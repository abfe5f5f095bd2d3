"""HunyuanVideo-1.5's transformer (`diffusers.HunyuanVideo15Transformer3DModel`) as blocks.

A call's sample is [rows, C, frames, h, w] (a video's latent frames are one row), and the model
takes 2C + 1 channels: the noise, then a first frame's latents and its mask (zeros in
text-to-video: `begin` adds them, as HunyuanVideo15Pipeline concatenates zeros). forward embeds
first: `rope` turns the latent's shape into rotary (cos, sin) for every token (no weights),
`x_embedder` (a Conv3d over 1×1×1 patches) makes the video tokens, `time_embed` turns the
timestep into `temb`; three token streams join as the text: Qwen2.5-VL's tokens through
`context_embedder` (a token refiner conditioned on the timestep and on the prompt's masked mean),
ByT5's glyph tokens through `context_embedder_2`, and an image's SigLIP tokens through
`image_embedder` (image-to-video), each plus its `cond_type_embed` row. Per row, the valid tokens
of each come first (image, glyphs, text) and the padding after, masked: the `embed` block. Then
each double-stream `transformer_blocks.{i}` maps (video tokens, text tokens) with temb, the mask
and the rotary frequencies: one block each. `norm_out` (modulated by temb) and `proj_out` end it;
unpatchifying is glue in `end`. No skips.

A text-to-video row has no image tokens: diffusers feeds 729 zero tokens, masked out of every
attention (as keys and as queries), so they change no valid token; a call of text-to-video rows
leaves them out (exact: a masked key's weight is 0). The text's padding stays, masked, cut to the
call's longest prompt by the pipeline (`text_columns`), as Qwen-Image's is. In a sequence group
each rank holds a slice of the video tokens and of the text tokens; in a tensor group, a share of
every block's heads and MLP features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import (
    TEXT_MASK,
    BlockCall,
    CacheBoundary,
    Cut,
    DenoiserInputs,
    Flow,
    Layout,
    SequenceSplit,
    TensorSplit,
    flow_timesteps,
    stacked_layout,
)
from server.engine.denoisers.dit import QKV, dit_boundary, out, token_rows

TEXT_TOKENS = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length: Qwen2.5-VL's tokens after the crop
GLYPHS = "encoder_hidden_states_2"  # ByT5's tokens of the prompt's quoted text, [rows, 256, D2]
GLYPH_MASK = "encoder_attention_mask_2"
GLYPH_TOKENS = 256  # tokenizer_2_max_length
IMAGE = "image_embeds"  # SigLIP's tokens of a first frame, [rows, 729, D3] (image-to-video)
IMAGE_TOKENS = 729  # siglip-so400m-patch14-384's: 27 × 27 patches
NATIVE_LATENT = 30  # 480 px / 16 (480p); the planner's square stand-in for 848×480
NATIVE_FRAMES = 31  # latent frames of 121 video frames (1 + 120 / 4)
TEXT, GLYPH, PICTURE = 0, 1, 2  # cond_type_embed's rows


class HunyuanVideo15TransformerSpec:
    """`diffusers.HunyuanVideo15Transformer3DModel`: HunyuanVideo-1.5, text- and image-to-video."""

    EMBEDDING = (
        "x_embedder",
        "image_embedder",
        "context_embedder",
        "context_embedder_2",
        "time_embed",
        "cond_type_embed",
        "rope",
    )
    OUTPUT = ("norm_out", "proj_out")

    def native_latent(self, model: nn.Module) -> int:
        return NATIVE_LATENT

    def layout(self, model: nn.Module) -> Layout:
        return stacked_layout(model, self.EMBEDDING, ("transformer_blocks",), self.OUTPUT)

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        size = (batch, config.out_channels, NATIVE_FRAMES, latent_size, latent_size)
        sample = torch.randn(size, dtype=dtype, device=device)
        context = torch.randn(batch, TEXT_TOKENS, config.text_embed_dim, dtype=dtype, device=device)
        glyphs = torch.randn(batch, GLYPH_TOKENS, config.text_embed_2_dim, dtype=dtype, device=device)
        conditioning = {
            GLYPHS: glyphs,
            TEXT_MASK: torch.ones(batch, TEXT_TOKENS, dtype=dtype, device=device),
            GLYPH_MASK: torch.ones(batch, GLYPH_TOKENS, dtype=dtype, device=device),
        }
        if config.task_type == "i2v":  # a first frame's SigLIP tokens join the text
            image = (batch, IMAGE_TOKENS, config.image_embed_dim)
            conditioning[IMAGE] = torch.randn(image, dtype=dtype, device=device)
        return DenoiserInputs(sample, flow_timesteps(batch, device), context, conditioning)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(inputs, (TEXT_MASK, GLYPHS, GLYPH_MASK, IMAGE), "HunyuanVideo-1.5")
        sample, wanted = rows["sample"], model.config.in_channels
        if sample.shape[1] < wanted:  # text-to-video: no first frame's latents nor mask (zeros)
            zeros = sample.new_zeros(sample.shape[0], wanted - sample.shape[1], *sample.shape[2:])
            rows["sample"] = torch.cat([sample, zeros], dim=1)
        for mask in (TEXT_MASK, GLYPH_MASK):
            rows[mask] = rows[mask].to(torch.bool)
        rows["timestep"] = rows["timestep"].to(sample.dtype)  # the pipeline's t.to(latents' dtype)
        return Flow(rows, {"size": tuple(sample.shape[2:]), "rotary": model.rope(sample)})  # no weights

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        calls.update(
            (f"transformer_blocks.{i}", BlockCall(b, joint)) for i, b in enumerate(model.transformer_blocks)
        )
        calls["out"] = BlockCall(model, out)  # norm_out(hidden, temb), proj_out
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        hidden, (frames, height, width) = flow.rows["hidden"], flow.shared["size"]
        p_t, p = model.config.patch_size_t, model.config.patch_size
        f, h, w = frames // p_t, height // p, width // p
        hidden = hidden.reshape(hidden.shape[0], f, h, w, -1, p_t, p, p)
        hidden = hidden.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        return dit_boundary(model.transformer_blocks, "transformer_blocks")

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Each block on a slice of the video tokens and of the text tokens (and their mask), with
        the rotary frequencies of the video slice; the blocks' pair mask is taken as its keys'
        (`runtime/sequence.py: keys_of`)."""
        blocks = frozenset(f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks)))
        return SequenceSplit(blocks, {"hidden": 1, "context": 1, "text_mask": 1}, rotary_slice)

    def tensor(self, model: nn.Module) -> TensorSplit:
        """Each double-stream block's joint attention by heads (both streams' projections; its q/k
        norms are per head), both MLPs, and both AdaLN modulations gathered: as dit.py's MMDiT."""
        blocks = "transformer_blocks.*"
        cuts = {f"{blocks}.attn.{p}": Cut.COLUMN for p in QKV}
        cuts |= {f"{blocks}.attn.to_out.0": Cut.ROW, f"{blocks}.attn.to_add_out": Cut.ROW}
        for ff in ("ff", "ff_context"):
            cuts |= {f"{blocks}.{ff}.net.0.proj": Cut.COLUMN, f"{blocks}.{ff}.net.2": Cut.ROW}
        cuts |= {f"{blocks}.{n}.linear": Cut.GATHERED for n in ("norm1", "norm1_context")}
        return TensorSplit(self.sequence(model).blocks, cuts)


def rotary_slice(shared: dict[str, Any], cuts: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """The rotary (cos, sin) [tokens, d] of a rank's video tokens."""
    start, stop, _ = cuts["hidden"]
    return {**shared, "rotary": tuple(x[start:stop] for x in shared["rotary"])}


# The blocks' calls: fn(owner, rows, shared) → rows, as HunyuanVideo15Transformer3DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    timestep, mask = rows["timestep"], rows[TEXT_MASK]
    hidden = model.x_embedder(rows["sample"])
    temb = model.time_embed(timestep)
    text = model.context_embedder(rows["context"], timestep, mask)
    kinds = model.cond_type_embed.weight
    streams = [
        Stream(model.context_embedder_2(rows[GLYPHS]) + kinds[GLYPH], rows[GLYPH_MASK]),
        Stream(text + kinds[TEXT], mask),
    ]
    if (image := rows.get(IMAGE)) is not None:  # a row of zeros is a text-to-video row: masked out
        shown = image.flatten(1).ne(0).any(1)[:, None].expand(image.shape[:2])
        tokens = model.image_embedder(image) * shown[..., None] + kinds[PICTURE]
        streams.insert(0, Stream(tokens, shown, keeps_padding=True))
    context, kept = valid_first(streams)
    return {"hidden": hidden, "temb": temb, "context": context, "text_mask": kept}


@dataclass(frozen=True)
class Stream:
    tokens: torch.Tensor  # [rows, T, D]
    mask: torch.Tensor  # [rows, T] bool: the valid tokens
    keeps_padding: bool = False  # forward zeroes the glyphs' and the text's padding, not an image's


def valid_first(streams: list[Stream]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid tokens of every stream first (in stream order), then their padding, and
    the joined mask: forward's order, by a stable sort of the masks (no data-dependent shapes,
    so the planner traces it on the meta device)."""
    tokens = torch.cat(
        [s.tokens if s.keeps_padding else torch.where(s.mask[..., None], s.tokens, 0) for s in streams], dim=1
    )
    mask = torch.cat([s.mask for s in streams], dim=1)
    order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)
    return tokens.gather(1, order[..., None].expand_as(tokens)), mask.gather(1, order)


def joint(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hidden, context = block(
        rows["hidden"], rows["context"], rows["temb"], rows["text_mask"], shared["rotary"]
    )
    return {**rows, "hidden": hidden, "context": context}
