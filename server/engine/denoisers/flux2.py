"""FLUX.2's transformer (`diffusers.Flux2Transformer2DModel`, [dev] and [klein]) as blocks.

The latents come patchified already (the family draws them as the pipeline does: 2x2 patches of
the VAE's 32 channels, 128 features a token) and are packed here by flattening, as
Flux2Pipeline._pack_latents. forward embeds first: `x_embedder` and `context_embedder` project the
image and text tokens, `time_guidance_embed` makes `temb` from the timestep (and, for [dev], the
embedded guidance scale), and three modulation layers turn temb into the modulations every
double-stream block (image, text) and every single-stream block shares; `pos_embed` (no weights)
makes the rotary embeddings of the 4-axis position ids (t, h, w, l): text token l at (0, 0, 0, l),
image token at (0, h, w, 0). Those form the `embed` block. Then 8 double-stream
`transformer_blocks` and 48 `single_transformer_blocks` (each joins the streams, text first, and
splits them again: `split_hidden_states`, so the flow is FLUX.1's), `norm_out` and `proj_out`.

Prompts come padded to 512 tokens, padding included, as the pipelines encode them: no mask.
An edit's reference images come as tokens of their own (`REFERENCES`), joined after the noise's
with their positions, and cut off at the end, as the pipelines do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import (
    REFERENCE_IDS,
    REFERENCES,
    BlockCall,
    CacheBoundary,
    DenoiserInputs,
    Flow,
    Layout,
    SequenceSplit,
    TensorSplit,
    diffusers_split,
    flow_timesteps,
    stacked_layout,
)
from server.engine.denoisers.dit import TOKENS, dit_boundary, out, token_rows
from server.engine.denoisers.flux import rotary_slice

TEXT_TOKENS = 512  # the pipelines' max_sequence_length default: prompts padded to it
MODULATIONS = ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")
STREAMS = ("transformer_blocks", "single_transformer_blocks")


def image_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """[h · w, 4] position ids (0, row, column, 0): Flux2Pipeline._prepare_latent_ids, made on
    `device` (no copy from the host a call)."""
    rows, columns = torch.meshgrid(
        torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, columns, zeros], dim=-1).reshape(-1, 4)


def text_ids(tokens: int, device: torch.device) -> torch.Tensor:
    """[tokens, 4] position ids (0, 0, 0, l): Flux2Pipeline._prepare_text_ids."""
    ids = torch.zeros(tokens, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(tokens, device=device)
    return ids


class Flux2TransformerSpec:
    """`diffusers.Flux2Transformer2DModel`: FLUX.2 [dev] (embedded guidance) and [klein] alike."""

    EMBEDDING = ("x_embedder", "context_embedder", "time_guidance_embed", *MODULATIONS, "pos_embed")
    OUTPUT = ("norm_out", "proj_out")

    def native_latent(self, model: nn.Module) -> int:
        return 64  # the pipelines' 1024 px: 64 tokens a side (16 px a token)

    def layout(self, model: nn.Module) -> Layout:
        return stacked_layout(model, self.EMBEDDING, STREAMS, self.OUTPUT)

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        size = (batch, config.in_channels, latent_size, latent_size)  # a latent pixel is a 2x2 patch
        sample = torch.randn(size, dtype=dtype, device=device)
        timestep = flow_timesteps(batch, device)
        context = torch.randn(batch, TEXT_TOKENS, config.joint_attention_dim, dtype=dtype, device=device)
        conditioning: dict[str, Any] = {}
        if config.guidance_embeds:
            conditioning["guidance"] = torch.full((batch,), 4.0, dtype=dtype, device=device)
        return DenoiserInputs(sample, timestep, context, conditioning)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(inputs, ("guidance", REFERENCES, REFERENCE_IDS), "FLUX.2")
        sample = rows.pop("sample")
        b, c, h, w = sample.shape
        hidden = sample.reshape(b, c, h * w).permute(0, 2, 1)  # Flux2Pipeline._pack_latents
        ids = image_ids(h, w, sample.device)
        references = rows.pop(REFERENCES, None)
        if references is not None:  # an edit's images, after the noise (the rows share their layout)
            hidden = torch.cat([hidden, references.to(hidden.dtype)], dim=1)
            ids = torch.cat([ids, rows.pop(REFERENCE_IDS)[0].round().to(ids.dtype)])
        rows["hidden"] = hidden
        # Flux2Pipeline passes t.to(latents.dtype) / 1000; forward multiplies by 1000 again
        rows["timestep"] = rows["timestep"].to(sample.dtype) / 1000
        text = model.pos_embed(text_ids(inputs.context.shape[1], sample.device))
        image = model.pos_embed(ids)
        rotary = tuple(torch.cat([t, i], dim=0) for t, i in zip(text, image, strict=True))
        return Flow(rows, {"size": (h, w), "rotary": rotary})

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        doubles = enumerate(model.transformer_blocks)
        calls.update((f"transformer_blocks.{i}", BlockCall(b, double)) for i, b in doubles)
        singles = enumerate(model.single_transformer_blocks)
        calls.update((f"single_transformer_blocks.{i}", BlockCall(b, single)) for i, b in singles)
        calls["out"] = BlockCall(model, out)  # the MMDiT's: norm_out(hidden, temb), proj_out
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        (h, w), hidden = flow.shared["size"], flow.rows["hidden"]
        return hidden[:, : h * w].permute(0, 2, 1).reshape(hidden.shape[0], -1, h, w)  # the noise's tokens

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        singles = len(model.single_transformer_blocks)
        last = f"single_transformer_blocks.{singles - 1}" if singles else None
        return dit_boundary(model.transformer_blocks, "transformer_blocks", last)

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Both streams' blocks on a slice of the image and of the text tokens, with the rotary
        embeddings of the positions the slice holds (text first, as the blocks join them)."""
        blocks = frozenset(f"{s}.{i}" for s in STREAMS for i in range(len(getattr(model, s))))
        return SequenceSplit(blocks, TOKENS, rotary_slice)

    def tensor(self, model: nn.Module) -> TensorSplit:
        """diffusers' own plan for FLUX.2 (`_tp_plan`: heads, SwiGLU halves, the single blocks'
        fused projections); its modulation is computed once, outside the blocks (`embed`)."""
        return diffusers_split(model, self.sequence(model).blocks)


# The blocks' calls: fn(owner, rows, shared) → rows, as Flux2Transformer2DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hidden = model.x_embedder(rows["hidden"])
    timestep = rows["timestep"].to(hidden.dtype) * 1000
    guidance = rows.get("guidance")
    temb = model.time_guidance_embed(timestep, None if guidance is None else guidance.to(hidden.dtype) * 1000)
    return {
        "hidden": hidden,
        "context": model.context_embedder(rows["context"]),
        "temb": temb,
        "mods": tuple(getattr(model, name)(temb) for name in MODULATIONS),
    }


def double(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    image_mod, text_mod, _ = rows["mods"]
    context, hidden = block(
        hidden_states=rows["hidden"],
        encoder_hidden_states=rows["context"],
        temb_mod_img=image_mod,
        temb_mod_txt=text_mod,
        image_rotary_emb=shared["rotary"],
    )
    return {**rows, "hidden": hidden, "context": context}


def single(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    context, hidden = block(
        hidden_states=rows["hidden"],
        encoder_hidden_states=rows["context"],
        temb_mod=rows["mods"][2],
        image_rotary_emb=shared["rotary"],
        split_hidden_states=True,
    )
    return {**rows, "hidden": hidden, "context": context}
