"""FLUX.1's transformer (`diffusers.FluxTransformer2DModel`) as blocks.

forward embeds first: `x_embedder` projects the packed latent tokens (2x2 patches of the
16-channel latent, 64 features each), `time_text_embed` turns the timestep (and, for
guidance-distilled checkpoints such as FLUX.1-dev, the guidance scale) and the pooled CLIP
vector into `temb`, `context_embedder` projects T5's tokens, and `pos_embed` turns the text and
image position ids into rotary embeddings (cos, sin) once for every block. Those form the
`embed` block. Then 19 double-stream `transformer_blocks` map (image tokens, text tokens) with
temb and the rotary embeddings, and 38 `single_transformer_blocks` do the same over both
streams joined inside each block (they return them apart again): one block each. `norm_out`
(modulated by temb) and `proj_out` end it. No skips: the image stream, the text stream, temb
and the rotary cos and sin cross every boundary.

A ControlNet's residuals (`controlnet_block_samples`, `controlnet_single_block_samples`, as
forward takes them: zeros on rows without a control) are added to the image stream after each
block, the i-th block taking sample i // ceil(blocks / samples) as forward does. `begin` lays
them out one a block, and each block takes the first and passes the rest on, so the blocks of a
stream keep one function (and one compiled graph).

Packing the latents and making the position ids are glue outside any module, done here in
`forward` as FluxPipeline does them, so a request's latents stay [B, 16, h, w] everywhere else.
FLUX.1 Kontext's edit image comes as tokens of its own (`REFERENCES`, packed as the noise is, at
positions whose first index is 1: `REFERENCE_IDS`), joined after the noise's; the prediction is
the noise's tokens alone, as FluxKontextPipeline cuts it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import (
    REFERENCE_IDS,
    REFERENCES,
    BlockCall,
    CacheBoundary,
    Cut,
    DenoiserInputs,
    Flow,
    Layout,
    SequenceSplit,
    TensorSplit,
    diffusers_split,
    flow_timesteps,
    present,
    stacked_layout,
)
from server.engine.denoisers.dit import TOKENS, carried, controlled, dit_boundary, out, token_rows

# a ControlNet's residuals (FluxControlNetModel's outputs, forward's kwargs), by the stream taking them
CONTROL = {
    "controlnet_block_samples": "transformer_blocks",
    "controlnet_single_block_samples": "single_transformer_blocks",
}
T5_TOKENS = 512  # FluxPipeline's max_sequence_length default (dev and schnell)
NATIVE_LATENT = 128  # FluxPipeline's default_sample_size: 1024 px; the config has no sample_size


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] → [B, h/2 · w/2, 4C]: FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h/2 · w/2, 4C] → [B, C, h, w]: FluxPipeline._unpack_latents, in latent sizes."""
    b, _, features = tokens.shape
    patches = tokens.view(b, h // 2, w // 2, features // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, features // 4, h, w)


def image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[h/2 · w/2, 3] position ids (0, row, column): FluxPipeline._prepare_latent_image_ids, made
    on `device` (made on the host, the copy to a GPU waited for the host every call)."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] += torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] += torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3).to(dtype)


class FluxTransformerSpec:
    """`diffusers.FluxTransformer2DModel`: FLUX.1 dev and schnell alike."""

    EMBEDDING = ("x_embedder", "time_text_embed", "context_embedder", "pos_embed", "encoder_hid_proj")
    OUTPUT = ("norm_out", "proj_out")

    def native_latent(self, model: nn.Module) -> int:
        return NATIVE_LATENT

    def layout(self, model: nn.Module) -> Layout:
        streams = ("transformer_blocks", "single_transformer_blocks")
        return stacked_layout(model, present(model, self.EMBEDDING), streams, present(model, self.OUTPUT))

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        size = (batch, config.in_channels // 4, latent_size, latent_size)
        sample = torch.randn(size, dtype=dtype, device=device)
        timestep = flow_timesteps(batch, device)
        context = torch.randn(batch, T5_TOKENS, config.joint_attention_dim, dtype=dtype, device=device)
        pooled = torch.randn(batch, config.pooled_projection_dim, dtype=dtype, device=device)
        conditioning: dict[str, Any] = {"pooled_projections": pooled}
        if config.guidance_embeds:
            conditioning["guidance"] = torch.full((batch,), 3.5, dtype=dtype, device=device)
        return DenoiserInputs(sample, timestep, context, conditioning)

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow:
        rows = token_rows(
            inputs, ("pooled_projections", "guidance", REFERENCES, REFERENCE_IDS, *CONTROL), "FLUX.1"
        )
        for key, stream in CONTROL.items():
            if key in rows:  # block i takes sample i // ceil(blocks / samples), as forward adds them
                blocks, samples = len(getattr(model, stream)), rows[key]
                rows[key] = tuple(samples[i // math.ceil(blocks / len(samples))] for i in range(blocks))
        sample = rows.pop("sample")
        _, _, h, w = sample.shape
        # FluxPipeline passes t.to(latents.dtype) / 1000; forward multiplies by 1000 again
        rows["timestep"] = rows["timestep"].to(sample.dtype) / 1000
        hidden = pack(sample)
        text_ids = torch.zeros(inputs.context.shape[1], 3, device=sample.device, dtype=sample.dtype)
        ids = torch.cat((text_ids, image_ids(h, w, sample.device, sample.dtype)), dim=0)
        references = rows.pop(REFERENCES, None)
        if references is not None:  # Kontext: an edit's image after the noise (the rows share its layout)
            hidden = torch.cat([hidden, references.to(hidden.dtype)], dim=1)
            ids = torch.cat([ids, rows.pop(REFERENCE_IDS)[0].to(ids.dtype)])
        rows["hidden"] = hidden
        return Flow(rows, {"size": (h, w), "rotary": model.pos_embed(ids)})  # pos_embed: no weights

    def calls(self, model: nn.Module) -> dict[str, BlockCall]:
        calls = {"embed": BlockCall(model, embed)}
        for stream, fn in (("transformer_blocks", joint), ("single_transformer_blocks", single)):
            calls.update((f"{stream}.{i}", BlockCall(b, fn)) for i, b in enumerate(getattr(model, stream)))
        calls["out"] = BlockCall(model, out)  # the MMDiT's: norm_out(hidden, temb), proj_out
        return calls

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor:
        h, w = flow.shared["size"]
        return unpack(flow.rows["hidden"][:, : (h // 2) * (w // 2)], h, w)  # the noise's tokens

    def boundary(self, model: nn.Module) -> CacheBoundary | None:
        singles = len(model.single_transformer_blocks)
        last = f"single_transformer_blocks.{singles - 1}" if singles else None
        return dit_boundary(model.transformer_blocks, "transformer_blocks", last)

    def sequence(self, model: nn.Module) -> SequenceSplit:
        """Both streams' blocks on a slice of the image and of the text tokens (and of a
        ControlNet's residuals, one an image token), with the rotary embeddings of the positions the
        slice holds."""
        blocks = frozenset(
            f"{stream}.{i}"
            for stream in ("transformer_blocks", "single_transformer_blocks")
            for i in range(len(getattr(model, stream)))
        )
        return SequenceSplit(blocks, {**TOKENS, **dict.fromkeys(CONTROL, 1)}, rotary_slice)

    def tensor(self, model: nn.Module) -> TensorSplit:
        """diffusers' own plan for FLUX.1 (`_tp_plan`: heads, MLPs and the single blocks' packed
        output), and each block's AdaLN modulation gathered (a sixth of a double block's weights)."""
        return diffusers_split(
            model,
            self.sequence(model).blocks,
            {
                "transformer_blocks.*.norm1.linear": Cut.GATHERED,
                "transformer_blocks.*.norm1_context.linear": Cut.GATHERED,
                "single_transformer_blocks.*.norm.linear": Cut.GATHERED,
            },
        )


def rotary_slice(shared: dict[str, Any], cuts: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """The rotary (cos, sin) of a rank's tokens: its text slice, then its image slice, the order
    the blocks join the streams in ([text, image], as the position ids were made)."""
    (t0, t1, text), (i0, i1, _) = cuts["context"], cuts["hidden"]
    rotary = tuple(torch.cat((x[t0:t1], x[text + i0 : text + i1])) for x in shared["rotary"])
    return {**shared, "rotary": rotary}


# The blocks' calls: fn(owner, rows, shared) → rows, as FluxTransformer2DModel.forward runs them.


def embed(model: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hidden = model.x_embedder(rows["hidden"])
    timestep = rows["timestep"].to(hidden.dtype) * 1000
    guidance = rows.get("guidance")
    if guidance is None:
        temb = model.time_text_embed(timestep, rows["pooled_projections"])
    else:
        temb = model.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, rows["pooled_projections"])
    out = {"hidden": hidden, "temb": temb, "context": model.context_embedder(rows["context"])}
    return carried(out, rows, CONTROL)


def joint(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """A double-stream block."""
    return controlled(_joint(block, rows, shared), rows, "controlnet_block_samples", CONTROL)


def single(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """A single-stream block (it takes and returns the streams apart, as a double one)."""
    return controlled(_joint(block, rows, shared), rows, "controlnet_single_block_samples", CONTROL)


def _joint(block: nn.Module, rows: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    context, hidden = block(
        hidden_states=rows["hidden"],
        encoder_hidden_states=rows["context"],
        temb=rows["temb"],
        image_rotary_emb=shared["rotary"],
    )
    return {"hidden": hidden, "temb": rows["temb"], "context": context}
